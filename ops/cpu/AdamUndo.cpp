#include "ops/cpu/AdamUndo.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ops/cpu/LowPrecision.h"
#include "ops/cpu/StepKernels.h"

// Note [Exact rollback]
// A speculative step is validated later; when it turns out invalid, the state before it must
// come back bit for bit. Keeping a copy of param, exp_avg and exp_avg_sq costs 12 bytes per
// parameter; inverting the step in fp32 (SuperOffload's inverse Adam) restores about 75% of
// elements. Here every field is *predicted* from the stepped values by inverting the step's
// operations in double precision, one rounding at a time where the step rounds twice (param:
// the update is recomputed exactly from the stepped moments, p1 - update gives the decayed
// param, dividing by the decay gives the param; exp_avg_sq likewise), and only the residual
// old - prediction, in units of the last place (modulo 2^32 of the order-preserving integer
// map ord, so every bit pattern has one), is logged. The prediction depends only on the
// stepped arrays, the gradient and the hyper-parameters, so adam_undo recomputes it exactly;
// correctness never depends on how good the prediction is, only the log's size does.
// The log: one 4-bit code per element and a side stream of zigzag varints, in element order.
// The code gives exp_avg's and exp_avg_sq's residuals as 0, +1, -1 or "in the side stream"
// (both moments lose the old value's low bits whenever the gradient term dominates it, by one
// unit mostly); the param's must be 0, and an element whose param misses, or whose moments
// both miss, takes the one escape code: all three residuals in the side stream (param,
// exp_avg_sq, exp_avg). param_lowp is round(param) unless the element's param entry carries
// a flag, followed by its 2 old bytes.
// Measured on Adam-shaped data (noise-dominated gradients, step 20 on): param and exp_avg_sq
// predictions exact for 96-99.6% of elements, exp_avg 71% exact and 21% off by one, so the
// log holds about 0.6 bytes per element (0.5 of codes). Young second moments log more (each
// side entry is 1-5 bytes): at step 2 exp_avg_sq is one gradient's square, mostly lost in the
// second's, 1.1-1.2 bytes per element; then 0.8 at step 3, and on a bf16 HF Llama's real
// gradients 0.85 at step 7 (1.08 with the earlier layout, which sent every exp_avg_sq miss,
// +-1 included, to the side stream), 0.58-0.6 from step 10.
// Speed: the predictions, residuals and codes are computed a block at a time in plain loops
// over arrays that the compiler vectorizes (one clone per x86 ISA level, picked at load
// time); divisions by constants are multiplications by their double reciprocals (a
// prediction only has to be close; recording and undo compute it identically). The side
// entries are written and read in a scalar pass that visits only the elements that have
// them (a bit mask per 64 elements); the step itself runs on blocks of kBlock elements whose
// old values are kept in stack buffers, so the extra reads hit the cache. The codes are
// computed with bit operations only (a select chain there did not vectorize: recording 25%
// slower). Measured on one core of a 2-core Xeon VM (AVX-512; 16M elements, AdamW, step 20):
// recording 4.6x the plain step's time with fp32 gradients, 4.8-5.1x with bf16 gradients and
// param_lowp (the earlier layout: 4.4x and 4.6-4.8x in the same runs), undo 3.5x and 4.2-4.6x
// (it parses the side stream twice: validation, then restore).
// Fields are restored in the order param, param_lowp, exp_avg, exp_avg_sq: the param
// prediction needs only the stepped exp_avg and exp_avg_sq, and the exp_avg prediction of L2
// Adam needs the restored param (g + wd * p).

namespace superchip::ops {
namespace {

constexpr int64_t kBlock = 1024;
// An element's code: bits 0-1 exp_avg, bits 2-3 exp_avg_sq, each kZero, kPlus, kMinus (residual
// 0, +1, -1) or kSide (in the side stream), the param exact (and param_lowp its rounding).
// kEscape (both kSide) also covers every element whose param is not exact: all three fields
// are then in the side stream.
constexpr uint8_t kZero = 0, kPlus = 1, kMinus = 2, kSide = 3;
constexpr int kVarShift = 2;
constexpr uint8_t kEscape = (kSide << kVarShift) | kSide;
// The longest side entries of one element: three 5-byte varints and 2 bytes of param_lowp.
constexpr int64_t kMaxSideBytes = 17;

// The vectorized block loops get one clone per x86 ISA level (ifunc, chosen at load time).
// Every clone computes the same bits: only IEEE operations, -ffp-contract=off for the file.
// Not under sanitizers: an ifunc resolver runs during relocation, before their runtimes start.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define SUPERCHIP_UNDO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SUPERCHIP_UNDO_CLONES
#endif

// A monotone map of float bits to integers that keeps -0 and +0 apart (fits in int32).
inline int32_t ord(uint32_t bits) {
  const int32_t sign = static_cast<int32_t>(bits) >> 31;
  return static_cast<int32_t>(bits & 0x7FFFFFFFu) ^ sign;
}

inline uint32_t unord(int32_t o) {
  const int32_t sign = o >> 31;
  return static_cast<uint32_t>(o ^ sign) | (static_cast<uint32_t>(sign) & 0x80000000u);
}

inline uint32_t bits_at(const float* x, int64_t j) {
  uint32_t u;
  std::memcpy(&u, x + j, sizeof u);
  return u;
}

// float_to_bf16 without a branch, for the vectorized loops.
inline uint16_t bf16_round(uint32_t u) {
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

uint16_t round_lowp(float x, DType d) {
  return d == DType::kBF16 ? float_to_bf16(x) : float_to_fp16(x);
}

// The step's constants, plus the reciprocals the predictions multiply by.
struct Predictor {
  detail::AdamScalars s;
  double inv_decay, c, inv_one_minus_c, one_plus_c, inv_c, inv_beta2;

  explicit Predictor(const detail::AdamScalars& sc) : s(sc) {
    inv_decay = 1.0 / static_cast<double>(s.decay_mul);
    c = s.lerp_coef;
    inv_one_minus_c = 1.0 / (1.0 - c);
    one_plus_c = 1.0 + c;
    inv_c = 1.0 / c;
    inv_beta2 = 1.0 / static_cast<double>(s.beta2);
  }
};

// Snaps a prediction to zero when it is rounding residue of the terms it came from.
inline float snap(double pred, double scale) {
  const float f = static_cast<float>(pred);  // unconditionally, so the select vectorizes
  return std::fabs(pred) <= std::fabs(scale) * 0x1p-21 ? 0.0f : f;
}

// max(|m|, |cg|) without fmax's NaN rules (a select the vectorizer takes); NaN inputs only
// make the prediction miss, which the side stream covers.
inline double larger_abs(float m, double cg) {
  const double am = std::fabs(static_cast<double>(m)), ac = std::fabs(cg);
  return am > ac ? am : ac;
}

// The gradient of [b, b + k) as fp32.
void load_grad(const AdamArrays& a, int64_t b, int64_t k, float* out) {
  switch (a.grad_dtype) {
    case DType::kBF16: {
      const uint16_t* g = static_cast<const uint16_t*>(a.grad) + b;
      for (int64_t j = 0; j < k; ++j) out[j] = bits_float(uint32_t{g[j]} << 16);
      break;
    }
    case DType::kF16: {
      const uint16_t* g = static_cast<const uint16_t*>(a.grad) + b;
      for (int64_t j = 0; j < k; ++j) out[j] = fp16_to_float(g[j]);
      break;
    }
    default: std::memcpy(out, static_cast<const float*>(a.grad) + b, static_cast<size_t>(k) * sizeof(float));
  }
}

// The old param predicted from the stepped param, exp_avg and exp_avg_sq: the update is the
// step's own (same fp32 operations), p1 - update undoes the addition's rounding and the
// division by the decay the multiplication's.
SUPERCHIP_UNDO_CLONES
void predict_param(const Predictor& pr, int64_t k, const float* __restrict p1, const float* __restrict m1,
                   const float* __restrict v1, float* __restrict out) {
  const float bc2 = pr.s.bc2_sqrt, eps = pr.s.eps, nss = pr.s.neg_step_size;
  for (int64_t j = 0; j < k; ++j) {
    const float denom = std::sqrt(v1[j]) / bc2 + eps;
    const float upd = (nss * m1[j]) / denom;
    out[j] = static_cast<float>(static_cast<double>(p1[j]) - static_cast<double>(upd));
  }
  if (pr.s.decoupled) {
    const double inv_decay = pr.inv_decay;
    for (int64_t j = 0; j < k; ++j) out[j] = static_cast<float>(static_cast<double>(out[j]) * inv_decay);
  }
}

// The gradient as the kernel used it: sign flipped when maximizing, L2 term added (needs the
// old param p0).
SUPERCHIP_UNDO_CLONES
void used_grad(const Predictor& pr, int64_t k, float* __restrict g, const float* __restrict p0) {
  const uint32_t mask = pr.s.sign_mask;
  const float wd = pr.s.wd;
  if (mask != 0) {
    for (int64_t j = 0; j < k; ++j) g[j] = -g[j];
  }
  if (pr.s.l2) {
    for (int64_t j = 0; j < k; ++j) g[j] = std::fma(p0[j], wd, g[j]);
  }
}

// The old exp_avg and exp_avg_sq predicted from the stepped ones and the used gradient.
// exp_avg_sq = fma(t, g, v0 * beta2) with t = (1 - beta2) * g: v1 - t * g (t * g is exact in
// double) gives v0 * beta2, the division by beta2 gives v0.
SUPERCHIP_UNDO_CLONES
void predict_moments(const Predictor& pr, int64_t k, const float* __restrict m1, const float* __restrict v1,
                     const float* __restrict g, float* __restrict pm, float* __restrict pv) {
  const double c = pr.c, a1 = pr.inv_one_minus_c, a2 = pr.one_plus_c, a3 = pr.inv_c, ib2 = pr.inv_beta2;
  const float omb2 = pr.s.one_minus_beta2;
  if (pr.s.lerp_small) {
    for (int64_t j = 0; j < k; ++j) {
      const double cg = c * g[j];
      pm[j] = snap((static_cast<double>(m1[j]) - cg) * a1, larger_abs(m1[j], cg));
    }
  } else {
    for (int64_t j = 0; j < k; ++j) {
      const double cg = c * g[j];
      pm[j] = snap((a2 * g[j] - static_cast<double>(m1[j])) * a3, larger_abs(m1[j], cg));
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    const double t = static_cast<double>(omb2 * g[j]) * static_cast<double>(g[j]);
    const float r = snap(static_cast<double>(v1[j]) - t, v1[j]);
    pv[j] = static_cast<float>(static_cast<double>(r) * ib2);
  }
}

// old - pred in units of the last place, modulo 2^32 (so every pair of bit patterns has one).
SUPERCHIP_UNDO_CLONES
void residuals(int64_t k, const float* __restrict old, const float* __restrict pred, int32_t* __restrict r) {
  for (int64_t j = 0; j < k; ++j) {
    r[j] = static_cast<int32_t>(static_cast<uint32_t>(ord(bits_at(old, j))) -
                                static_cast<uint32_t>(ord(bits_at(pred, j))));
  }
}

// The inverse of residuals: old = pred + r.
SUPERCHIP_UNDO_CLONES
void apply_residuals(int64_t k, const float* __restrict pred, const int32_t* __restrict r, float* __restrict out) {
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t o = static_cast<uint32_t>(ord(bits_at(pred, j))) + static_cast<uint32_t>(r[j]);
    out[j] = bits_float(unord(static_cast<int32_t>(o)));
  }
}

// One field's two code bits for residual r: kZero, kPlus, kMinus or kSide (bit operations only,
// so the loops below vectorize).
inline uint32_t field_code(int32_t r) {
  const uint32_t big = static_cast<uint32_t>(r) + 1u > 2u;  // |r| > 1
  return static_cast<uint32_t>(r == 1) | (static_cast<uint32_t>(r == -1) << 1) | (big * kSide);
}

// Whether an element with code c has side entries.
inline uint8_t has_side(uint8_t c) {
  return static_cast<uint8_t>(((c & kSide) == kSide) | ((c >> kVarShift) == kSide));
}

// Each element's code, and side[j] != 0 when it has side entries.
SUPERCHIP_UNDO_CLONES
void make_codes(int64_t k, const int32_t* __restrict rp, const uint8_t* __restrict lowp_off,
                const int32_t* __restrict rv, const int32_t* __restrict rm, uint8_t* __restrict code,
                uint8_t* __restrict side) {
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t escape = 0u - static_cast<uint32_t>((rp[j] != 0) | (lowp_off[j] != 0));  // all ones
    const uint32_t v = field_code(rv[j]), m = field_code(rm[j]);
    const uint32_t c = ((v << kVarShift) | m | escape) & kEscape;
    code[j] = static_cast<uint8_t>(c);
    side[j] = static_cast<uint8_t>((v == kSide) | (m == kSide) | (escape & 1u));
  }
}

// Codes of [0, k) into nibbles, two per byte (low nibble first).
SUPERCHIP_UNDO_CLONES
void pack_codes(int64_t k, const uint8_t* __restrict code, uint8_t* __restrict out) {
  for (int64_t j = 0; j < k / 2; ++j) out[j] = static_cast<uint8_t>(code[2 * j] | (code[2 * j + 1] << 4));
  if (k & 1) out[k / 2] = code[k - 1];
}

// The inverse of pack_codes, and side[j] as make_codes sets it.
SUPERCHIP_UNDO_CLONES
void unpack_codes(int64_t k, const uint8_t* __restrict in, uint8_t* __restrict code, uint8_t* __restrict side) {
  for (int64_t j = 0; j < k / 2; ++j) {
    code[2 * j] = in[j] & 0xF;
    code[2 * j + 1] = in[j] >> 4;
  }
  if (k & 1) code[k - 1] = in[k / 2] & 0xF;
  for (int64_t j = 0; j < k; ++j) side[j] = has_side(code[j]);
}

// The residuals the codes hold: 0/+1/-1 of exp_avg and exp_avg_sq (side entries overwrite the rest).
SUPERCHIP_UNDO_CLONES
void code_residuals(int64_t k, const uint8_t* __restrict code, int32_t* __restrict rp, int32_t* __restrict rv,
                    int32_t* __restrict rm) {
  for (int64_t j = 0; j < k; ++j) {
    const int32_t m = code[j] & kSide, v = code[j] >> kVarShift;
    rp[j] = 0;
    rv[j] = (v == kPlus) - (v == kMinus);
    rm[j] = (m == kPlus) - (m == kMinus);
  }
}

// bit j % 64 of mask[j / 64] set when side[j] != 0, so the scalar passes visit only the
// elements with side entries (a branch per skipped element mispredicts at ~10% density).
SUPERCHIP_UNDO_CLONES
void side_mask(int64_t k, const uint8_t* __restrict side, uint64_t* __restrict mask) {
  for (int64_t w = 0; w * 64 < k; ++w) {
    const int64_t e = std::min<int64_t>(64, k - 64 * w);
    uint64_t m = 0;
    for (int64_t j = 0; j < e; ++j) m |= static_cast<uint64_t>(side[64 * w + j] != 0) << j;
    mask[w] = m;
  }
}

// Calls visit(j) for each element j of the block with side entries, in order.
template <class Visit>
inline void for_each_side(int64_t k, const uint8_t* side, Visit visit) {
  uint64_t mask[kBlock / 64];
  side_mask(k, side, mask);
  for (int64_t w = 0; w * 64 < k; ++w) {
    for (uint64_t m = mask[w]; m != 0; m &= m - 1) visit(64 * w + __builtin_ctzll(m));
  }
}

inline uint32_t zigzag(int32_t r) {
  return (static_cast<uint32_t>(r) << 1) ^ static_cast<uint32_t>(r >> 31);
}

inline int32_t unzigzag(uint32_t z) { return static_cast<int32_t>((z >> 1) ^ (0u - (z & 1u))); }

inline uint8_t* put_varint(uint8_t* out, uint64_t x) {
  while (x >= 0x80) {
    *out++ = static_cast<uint8_t>(x | 0x80);
    x >>= 7;
  }
  *out++ = static_cast<uint8_t>(x);
  return out;
}

[[noreturn]] void mismatched_log(const std::string& what) {
  throw std::invalid_argument("adam_undo: " + what + " (log and arrays do not belong together)");
}

// Reads the side stream; every read is bounds-checked, so a log that does not belong to the
// arrays throws instead of reading past its end.
struct SideReader {
  const uint8_t* at;
  const uint8_t* end;

  uint64_t varint(int max_bits) {
    if (at != end && *at < 0x80) return *at++;  // most entries are one byte
    uint64_t x = 0;
    for (int shift = 0;; shift += 7) {
      if (at == end) mismatched_log("the side stream ends early");
      const uint8_t b = *at++;
      x |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) break;
      if (shift >= 28) mismatched_log("a side entry is longer than 5 bytes");
    }
    if (x >> max_bits) mismatched_log("a side entry is out of range");
    return x;
  }

  uint16_t u16() {
    if (end - at < 2) mismatched_log("the side stream ends early");
    const uint16_t v = static_cast<uint16_t>(at[0] | (at[1] << 8));
    at += 2;
    return v;
  }
};

// Fills the residuals of a block's elements that have side entries (and param_lowp's old
// bits where flagged, in lraw with lowp_off[j] = 1).
void read_side(int64_t k, const uint8_t* code, const uint8_t* side, bool lowp, SideReader& in, int32_t* rp,
               int32_t* rv, int32_t* rm, uint8_t* lowp_off, uint16_t* lraw) {
  for_each_side(k, side, [&](int64_t j) {
    const uint8_t c = code[j];
    if (c == kEscape) {
      uint64_t x = in.varint(lowp ? 33 : 32);
      if (lowp) {
        lowp_off[j] = static_cast<uint8_t>(x & 1);
        x >>= 1;
        if (lowp_off[j]) lraw[j] = in.u16();
      }
      rp[j] = unzigzag(static_cast<uint32_t>(x));
    }
    if ((c >> kVarShift) == kSide) rv[j] = unzigzag(static_cast<uint32_t>(in.varint(32)));
    if ((c & kSide) == kSide) rm[j] = unzigzag(static_cast<uint32_t>(in.varint(32)));
  });
}

void check_undo_args(const char* fn, const AdamHyper& h) {
  if (h.amsgrad) {
    throw std::invalid_argument(std::string(fn) + ": amsgrad steps cannot be undone exactly "
                                "(the running max is not invertible); step them without speculation");
  }
}

}  // namespace

void adam_step_recording(const AdamHyper& h, const AdamArrays& a, SimdPath path, AdamUndoLog* log) {
  check_undo_args("adam_step_recording", h);
  if (log == nullptr) throw std::invalid_argument("adam_step_recording: log is null");
  detail::check_adam_args(h, a);
  log->n = a.n;
  log->escapes = 0;
  log->codes.assign(static_cast<size_t>((a.n + 1) / 2), 0);
  log->side.clear();
  const Predictor pr(detail::adam_scalars(h));
  const bool lowp = a.param_lowp != nullptr;
  float p0[kBlock], m0[kBlock], v0[kBlock], g[kBlock], pp[kBlock], pm[kBlock], pv[kBlock];
  int32_t rp[kBlock], rm[kBlock], rv[kBlock];
  uint16_t l0[kBlock];
  uint8_t code[kBlock], side[kBlock], lowp_off[kBlock];
  uint8_t buf[kBlock * kMaxSideBytes];
  if (!lowp) std::memset(lowp_off, 0, sizeof lowp_off);
  for (int64_t b = 0; b < a.n; b += kBlock) {
    const int64_t k = std::min(kBlock, a.n - b);
    const size_t fb = static_cast<size_t>(k) * sizeof(float);
    std::memcpy(p0, a.param + b, fb);
    std::memcpy(m0, a.exp_avg + b, fb);
    std::memcpy(v0, a.exp_avg_sq + b, fb);
    if (lowp) std::memcpy(l0, static_cast<const uint16_t*>(a.param_lowp) + b, k * sizeof(uint16_t));
    AdamArrays blk = a;
    blk.param += b;
    blk.exp_avg += b;
    blk.exp_avg_sq += b;
    blk.grad = static_cast<const char*>(a.grad) + b * (a.grad_dtype == DType::kF32 ? 4 : 2);
    if (lowp) blk.param_lowp = static_cast<uint16_t*>(a.param_lowp) + b;
    blk.n = k;
    adam_step(h, blk, path, nullptr);

    predict_param(pr, k, a.param + b, a.exp_avg + b, a.exp_avg_sq + b, pp);
    load_grad(a, b, k, g);
    used_grad(pr, k, g, p0);
    predict_moments(pr, k, a.exp_avg + b, a.exp_avg_sq + b, g, pm, pv);
    residuals(k, p0, pp, rp);
    residuals(k, m0, pm, rm);
    residuals(k, v0, pv, rv);
    if (lowp) {
      if (a.lowp_dtype == DType::kBF16) {
        for (int64_t j = 0; j < k; ++j) lowp_off[j] = bf16_round(bits_at(p0, j)) != l0[j];
      } else {
        for (int64_t j = 0; j < k; ++j) lowp_off[j] = round_lowp(p0[j], a.lowp_dtype) != l0[j];
      }
    }
    make_codes(k, rp, lowp_off, rv, rm, code, side);
    pack_codes(k, code, log->codes.data() + b / 2);  // b is even: blocks start on a byte

    // The side entries, in element order: param (with the param_lowp flag and bits), then
    // exp_avg_sq, then exp_avg.
    uint8_t* out = buf;
    for_each_side(k, side, [&](int64_t j) {
      const uint8_t c = code[j];
      if (c == kEscape) {
        const uint64_t z = zigzag(rp[j]);
        out = put_varint(out, lowp ? (z << 1) | lowp_off[j] : z);
        if (lowp && lowp_off[j]) {
          *out++ = static_cast<uint8_t>(l0[j] & 0xFF);
          *out++ = static_cast<uint8_t>(l0[j] >> 8);
        }
        ++log->escapes;
      }
      if ((c >> kVarShift) == kSide) {
        out = put_varint(out, zigzag(rv[j]));
        ++log->escapes;
      }
      if ((c & kSide) == kSide) {
        out = put_varint(out, zigzag(rm[j]));
        ++log->escapes;
      }
    });
    log->side.insert(log->side.end(), buf, out);
  }
  // The log is kept until the step is validated: no growth slack beyond a quarter.
  if (log->side.capacity() > log->side.size() + log->side.size() / 4) log->side.shrink_to_fit();
}

void adam_undo(const AdamHyper& h, const AdamArrays& a, const AdamUndoLog& log) {
  check_undo_args("adam_undo", h);
  detail::check_adam_args(h, a);
  if (log.n != a.n || static_cast<int64_t>(log.codes.size()) != (a.n + 1) / 2) {
    mismatched_log("the log covers " + std::to_string(log.n) + " elements with " +
                   std::to_string(log.codes.size()) + " code bytes, the arrays hold " + std::to_string(a.n));
  }
  const bool lowp = a.param_lowp != nullptr;
  float g[kBlock], pp[kBlock], pm[kBlock], pv[kBlock], p0[kBlock], m0[kBlock], v0[kBlock];
  int32_t rp[kBlock], rm[kBlock], rv[kBlock];
  uint16_t l0[kBlock], lraw[kBlock];
  uint8_t code[kBlock], side[kBlock], lowp_off[kBlock];
  // Checked before anything is written: the side stream holds exactly the entries the codes name.
  {
    SideReader in{log.side.data(), log.side.data() + log.side.size()};
    for (int64_t b = 0; b < a.n; b += kBlock) {
      const int64_t k = std::min(kBlock, a.n - b);
      unpack_codes(k, log.codes.data() + b / 2, code, side);
      read_side(k, code, side, lowp, in, rp, rv, rm, lowp_off, lraw);
    }
    if (in.at != in.end) {
      mismatched_log("the side stream holds " + std::to_string(in.end - in.at) + " bytes no code names");
    }
  }
  const Predictor pr(detail::adam_scalars(h));
  SideReader in{log.side.data(), log.side.data() + log.side.size()};
  for (int64_t b = 0; b < a.n; b += kBlock) {
    const int64_t k = std::min(kBlock, a.n - b);
    unpack_codes(k, log.codes.data() + b / 2, code, side);
    code_residuals(k, code, rp, rv, rm);
    std::memset(lowp_off, 0, static_cast<size_t>(k));
    read_side(k, code, side, lowp, in, rp, rv, rm, lowp_off, lraw);
    predict_param(pr, k, a.param + b, a.exp_avg + b, a.exp_avg_sq + b, pp);
    apply_residuals(k, pp, rp, p0);
    if (lowp) {
      if (a.lowp_dtype == DType::kBF16) {
        for (int64_t j = 0; j < k; ++j) l0[j] = lowp_off[j] ? lraw[j] : bf16_round(bits_at(p0, j));
      } else {
        for (int64_t j = 0; j < k; ++j) l0[j] = lowp_off[j] ? lraw[j] : round_lowp(p0[j], a.lowp_dtype);
      }
    }
    load_grad(a, b, k, g);
    used_grad(pr, k, g, p0);
    predict_moments(pr, k, a.exp_avg + b, a.exp_avg_sq + b, g, pm, pv);
    apply_residuals(k, pm, rm, m0);
    apply_residuals(k, pv, rv, v0);
    const size_t fb = static_cast<size_t>(k) * sizeof(float);
    std::memcpy(a.param + b, p0, fb);
    std::memcpy(a.exp_avg + b, m0, fb);
    std::memcpy(a.exp_avg_sq + b, v0, fb);
    if (lowp) std::memcpy(static_cast<uint16_t*>(a.param_lowp) + b, l0, k * sizeof(uint16_t));
  }
}

}  // namespace superchip::ops
