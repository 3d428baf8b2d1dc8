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
// operations one at a time (param: the update is recomputed exactly from the stepped
// moments, p1 - update gives the decayed param, dividing by the decay gives the param;
// exp_avg_sq: fma(-t, g, v1) gives v0 * beta2 with the product exact, divided by beta2;
// exp_avg likewise from its lerp), and only the residual old - prediction, in units of the
// last place (modulo 2^32 of the order-preserving integer map ord, so every bit pattern has
// one), is logged. The prediction depends only on the stepped arrays, the gradient and the
// hyper-parameters, so adam_undo recomputes it exactly (the same inline fp32 operations on
// both sides); correctness never depends on how good the prediction is, only the log's size.
// The log: one 4-bit code per element and a side stream of zigzag varints, in element order.
// The code gives exp_avg's and exp_avg_sq's residuals as 0, +1, -1 or "in the side stream"
// (both moments lose the old value's low bits whenever the gradient term dominates it, by one
// unit mostly); the param's must be 0, and an element whose param misses, or whose moments
// both miss, takes the one escape code: all three residuals in the side stream (param,
// exp_avg_sq, exp_avg). param_lowp is round(param) unless the element's param entry carries
// a flag, followed by its 2 old bytes.
// Measured on Adam-shaped data (noise-dominated gradients, step 20 on), about 0.62 bytes per
// element (0.5 of codes). Young second moments log more (each side entry is 1-5 bytes): at
// step 2 exp_avg_sq is one gradient's square, mostly lost in the second's, about 1.2 bytes
// per element; then 0.84 at step 3, 0.64 at step 10 (test/cpp/ops/adam_undo_test.cpp prints
// them). Predictions in double precision logged 2-7% less (0.61 at step 30) at twice the
// recording's time.
// Speed: the recording is one vectorized pass per block of kBlock elements: the step itself
// (adam_block's operations, StepLoop.h, so the bits of every SIMD path; the old values stay
// in registers) and each field's prediction, residual and code (one clone per x86 ISA level,
// picked at load time; the flags are bit-mask selects, since an invariant condition in the
// loop stops GCC's vectorizer). The side entries are then written in a scalar pass that visits
// only the elements that have them (a bit mask per 64 elements). Measured on one core of a
// 2-core Xeon VM (AVX-512; 16M elements, AdamW, step 20): recording 2.4x the plain step's
// time with fp32 gradients, 3.4x with bf16 gradients and a bf16 param_lowp (the earlier
// layout, the kernel's step then separate prediction passes in double: 4.8x and 5.2x in the
// same runs); undo 3.4x and 4.4x (it parses the side stream twice: validation, then restore).
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
// The per-element pieces are inlined into every clone (a call in a loop stops the vectorizer).
#if defined(__GNUC__)
#define SUPERCHIP_UNDO_INLINE inline __attribute__((always_inline))
#else
#define SUPERCHIP_UNDO_INLINE inline
#endif

// A monotone map of float bits to integers that keeps -0 and +0 apart (fits in int32).
SUPERCHIP_UNDO_INLINE int32_t ord(uint32_t bits) {
  const int32_t sign = static_cast<int32_t>(bits) >> 31;
  return static_cast<int32_t>(bits & 0x7FFFFFFFu) ^ sign;
}

inline uint32_t unord(int32_t o) {
  const int32_t sign = o >> 31;
  return static_cast<uint32_t>(o ^ sign) | (static_cast<uint32_t>(sign) & 0x80000000u);
}

SUPERCHIP_UNDO_INLINE uint32_t bits_at(const float* x, int64_t j) {
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

// The step's constants, plus those the predictions use: a prediction inverts one step
// operation at a time in fp32, each inversion one FMA (exact product, one rounding) or one
// division (correctly rounded; reciprocals logged 5% more).
struct Predictor {
  detail::AdamScalars s;
  float ka, kb, kd;  // exp_avg's prediction: fma(ka, g, kb * m1) / kd, either lerp form
  float decay;       // AdamW's decay factor, 1 for Adam (x / 1 is x)

  explicit Predictor(const detail::AdamScalars& sc) : s(sc) {
    decay = s.decoupled ? s.decay_mul : 1.0f;
    const double c = s.lerp_coef;
    if (s.lerp_small) {  // m1 = m0 + c (g - m0): m0 = (m1 - c g) / (1 - c)
      ka = static_cast<float>(-c);
      kb = 1.0f;
      kd = static_cast<float>(1.0 - c);
    } else {  // m1 = g + c (g - m0): m0 = ((1 + c) g - m1) / c
      ka = static_cast<float>(1.0 + c);
      kb = -1.0f;
      kd = static_cast<float>(c);
    }
  }
};

// Per-element pieces, inlined into the recording's fused loop and the undo's block loops
// alike: the same IEEE operations in both, so the undo recomputes the recording's
// predictions bit for bit (a prediction only has to be close; that both sides compute the
// same one is what matters).

// The step's update from the stepped moments: adam_block's operations (StepLoop.h).
SUPERCHIP_UNDO_INLINE float step_update(const detail::AdamScalars& s, float m1, float v1) {
  const float denom = std::sqrt(v1) / s.bc2_sqrt + s.eps;
  return (s.neg_step_size * m1) / denom;
}

// The old param: p1 - update undoes the addition's rounding, the division by the decay the
// multiplication's (a division, not a reciprocal: a param that misses escapes).
SUPERCHIP_UNDO_INLINE float predict_param(const Predictor& pr, float p1, float upd) {
  return (p1 - upd) / pr.decay;
}

// A prediction snapped to zero when r, its numerator, is rounding residue of terms of size
// `scale`.
SUPERCHIP_UNDO_INLINE float snap(float r, float scale, float pred) {
  return std::fabs(r) <= scale * 0x1p-21f ? 0.0f : pred;
}

// The old exp_avg from the stepped one and the used gradient. The scale is max(|m1|, |c g|)
// as a select (fmax's NaN rules do not vectorize); NaN inputs only make the prediction miss,
// which the side stream covers.
SUPERCHIP_UNDO_INLINE float predict_exp_avg(const Predictor& pr, float m1, float g) {
  const float r = std::fma(pr.ka, g, pr.kb * m1);
  const float am = std::fabs(m1), ac = std::fabs(pr.s.lerp_coef * g);
  return snap(r, am > ac ? am : ac, r / pr.kd);
}

// The old exp_avg_sq: the step computes fma(t, g, v0 * beta2) with t = (1 - beta2) * g, so
// fma(-t, g, v1) gives v0 * beta2 (t * g exact inside the FMA), divided by beta2 v0.
SUPERCHIP_UNDO_INLINE float predict_exp_avg_sq(const Predictor& pr, float v1, float g) {
  const float t = pr.s.one_minus_beta2 * g;
  const float r = std::fma(-t, g, v1);
  return snap(r, std::fabs(v1), r / pr.s.beta2);
}

// old - pred in units of the last place, modulo 2^32 (so every pair of bit patterns has one).
SUPERCHIP_UNDO_INLINE int32_t residual(float old, float pred) {
  uint32_t o, p;
  std::memcpy(&o, &old, sizeof o);
  std::memcpy(&p, &pred, sizeof p);
  return static_cast<int32_t>(static_cast<uint32_t>(ord(o)) - static_cast<uint32_t>(ord(p)));
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

// The old params of a block, from the stepped param, exp_avg and exp_avg_sq (undo).
SUPERCHIP_UNDO_CLONES
void predict_params(const Predictor& pr, int64_t k, const float* __restrict p1, const float* __restrict m1,
                    const float* __restrict v1, float* __restrict out) {
  for (int64_t j = 0; j < k; ++j) out[j] = predict_param(pr, p1[j], step_update(pr.s, m1[j], v1[j]));
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

// The old exp_avg and exp_avg_sq of a block, from the stepped ones and the used gradient (undo).
SUPERCHIP_UNDO_CLONES
void predict_moments(const Predictor& pr, int64_t k, const float* __restrict m1, const float* __restrict v1,
                     const float* __restrict g, float* __restrict pm, float* __restrict pv) {
  for (int64_t j = 0; j < k; ++j) {
    pm[j] = predict_exp_avg(pr, m1[j], g[j]);
    pv[j] = predict_exp_avg_sq(pr, v1[j], g[j]);
  }
}

// The inverse of residual(): old = pred + r.
SUPERCHIP_UNDO_CLONES
void apply_residuals(int64_t k, const float* __restrict pred, const int32_t* __restrict r, float* __restrict out) {
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t o = static_cast<uint32_t>(ord(bits_at(pred, j))) + static_cast<uint32_t>(r[j]);
    out[j] = bits_float(unord(static_cast<int32_t>(o)));
  }
}

// One field's two code bits for residual r: kZero, kPlus, kMinus or kSide (bit operations only,
// so the loops below vectorize).
SUPERCHIP_UNDO_INLINE uint32_t field_code(int32_t r) {
  const uint32_t big = static_cast<uint32_t>(r) + 1u > 2u;  // |r| > 1
  return static_cast<uint32_t>(r == 1) | (static_cast<uint32_t>(r == -1) << 1) | (big * kSide);
}

// Whether an element with code c has side entries.
inline uint8_t has_side(uint8_t c) {
  return static_cast<uint8_t>(((c & kSide) == kSide) | ((c >> kVarShift) == kSide));
}

// One element's code from its residuals (bit operations only, so the loop vectorizes);
// *side != 0 when it has side entries.
SUPERCHIP_UNDO_INLINE uint8_t element_code(int32_t rp, uint8_t lowp_off, int32_t rv, int32_t rm, uint8_t* side) {
  const uint32_t escape = 0u - static_cast<uint32_t>((rp != 0) | (lowp_off != 0));  // all ones
  const uint32_t v = field_code(rv), m = field_code(rm);
  *side = static_cast<uint8_t>((v == kSide) | (m == kSide) | (escape & 1u));
  return static_cast<uint8_t>(((v << kVarShift) | m | escape) & kEscape);
}

// The recorded step of a block, in one pass: adam_block's operations (StepLoop.h: the same
// IEEE operations in the same order, so the same bits as every SIMD path), then, from the
// values still in registers, each field's prediction, residual and code. `g` is the
// gradient as stored (sign and L2 term applied here); p, m, v are stepped in place.
SUPERCHIP_UNDO_CLONES
void step_and_record(const Predictor& pr, int64_t k, float* __restrict p, float* __restrict m,
                     float* __restrict v, const float* __restrict g, const uint8_t* __restrict lowp_off,
                     int32_t* __restrict rp, int32_t* __restrict rm, int32_t* __restrict rv,
                     uint8_t* __restrict code, uint8_t* __restrict side) {
  // Loop invariants as locals, and the flags as bit masks of selects (an invariant condition
  // left in the loop stops GCC's vectorizer).
  const uint32_t sign_mask = pr.s.sign_mask;
  const uint32_t l2 = pr.s.l2 ? ~0u : 0u, small = pr.s.lerp_small ? ~0u : 0u;
  const float decay = pr.s.decoupled ? pr.s.decay_mul : 1.0f;  // p * 1 is p (a NaN stays NaN)
  const float wd = pr.s.wd, lerp_coef = pr.s.lerp_coef;
  const float one_minus_beta2 = pr.s.one_minus_beta2, beta2 = pr.s.beta2;
  for (int64_t j = 0; j < k; ++j) {
    const float p0 = p[j], m0 = m[j], v0 = v[j];
    const uint32_t g0 = bits_at(g, j) ^ sign_mask;
    const float pd = p0 * decay;
    const float gu = bits_float((float_bits(std::fma(p0, wd, bits_float(g0))) & l2) | (g0 & ~l2));
    const float m1 = std::fma(lerp_coef, gu - m0, bits_float((float_bits(m0) & small) | (float_bits(gu) & ~small)));
    const float v1 = std::fma(one_minus_beta2 * gu, gu, v0 * beta2);
    const float upd = step_update(pr.s, m1, v1);
    const float p1 = pd + upd;
    p[j] = p1;
    m[j] = m1;
    v[j] = v1;
    rp[j] = residual(p0, predict_param(pr, p1, upd));
    rm[j] = residual(m0, predict_exp_avg(pr, m1, gu));
    rv[j] = residual(v0, predict_exp_avg_sq(pr, v1, gu));
    code[j] = element_code(rp[j], lowp_off[j], rv[j], rm[j], side + j);
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
  if (!simd_path_supported(path)) {
    throw std::invalid_argument(std::string("adam_step_recording: SIMD path ") + simd_path_name(path) +
                                " is not supported on this CPU or build");
  }
  if (log == nullptr) throw std::invalid_argument("adam_step_recording: log is null");
  detail::check_adam_args(h, a);
  log->n = a.n;
  log->escapes = 0;
  log->codes.assign(static_cast<size_t>((a.n + 1) / 2), 0);
  log->side.clear();
  const Predictor pr(detail::adam_scalars(h));
  const bool lowp = a.param_lowp != nullptr;
  float g[kBlock];
  int32_t rp[kBlock], rm[kBlock], rv[kBlock];
  uint16_t l0[kBlock];
  uint8_t code[kBlock], side[kBlock], lowp_off[kBlock];
  uint8_t buf[kBlock * kMaxSideBytes];
  if (!lowp) std::memset(lowp_off, 0, sizeof lowp_off);
  for (int64_t b = 0; b < a.n; b += kBlock) {
    const int64_t k = std::min(kBlock, a.n - b);
    float* const pb = a.param + b;
    uint16_t* const lb = lowp ? static_cast<uint16_t*>(a.param_lowp) + b : nullptr;
    load_grad(a, b, k, g);
    if (lowp) {  // whether param_lowp is the old param's rounding, before the step
      std::memcpy(l0, lb, static_cast<size_t>(k) * sizeof(uint16_t));
      if (a.lowp_dtype == DType::kBF16) {
        for (int64_t j = 0; j < k; ++j) lowp_off[j] = bf16_round(bits_at(pb, j)) != l0[j];
      } else {
        for (int64_t j = 0; j < k; ++j) lowp_off[j] = round_lowp(pb[j], a.lowp_dtype) != l0[j];
      }
    }
    step_and_record(pr, k, pb, a.exp_avg + b, a.exp_avg_sq + b, g, lowp_off, rp, rm, rv, code, side);
    if (lowp) {  // the stepped param's rounding, as the kernels store it
      if (a.lowp_dtype == DType::kBF16) {
        for (int64_t j = 0; j < k; ++j) lb[j] = bf16_round(bits_at(pb, j));
      } else {
        for (int64_t j = 0; j < k; ++j) lb[j] = round_lowp(pb[j], a.lowp_dtype);
      }
    }
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
    predict_params(pr, k, a.param + b, a.exp_avg + b, a.exp_avg_sq + b, pp);
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
