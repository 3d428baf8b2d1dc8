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
// elements. Here every field is *predicted* from the stepped values by inverting the step in
// double precision, and the difference between the true old value and the prediction is
// stored in units of the last place: a small ord(old) - ord(pred) takes a 2- or 3-bit code
// (kCodes), anything else (cancellation, zeros that the prediction misses, NaN) code 3 and an
// exception entry with the old bits. The prediction depends only on the stepped arrays, the
// gradient and the hyper-parameters, so adam_undo recomputes it exactly; correctness never
// depends on how good the prediction is, only the exception rate does. Cost: one byte per
// element written during the step (the codes), plus 8 bytes per exception; the extra reads
// hit the cache because the step runs in blocks of kBlock elements whose old values are kept
// in a stack buffer.
// Speed: the predictions and codes are computed a block at a time in plain loops over arrays
// that the compiler vectorizes (one clone per x86 ISA level, picked at load time); divisions
// by constants are multiplications by their double reciprocals (a prediction only has to be
// close; recording and undo compute it identically). Exceptions are handled in a scalar pass
// over the block, which is cheap because they are rare.
// Fields are restored in the order param, param_lowp, exp_avg, exp_avg_sq: the param
// prediction needs only the stepped exp_avg and exp_avg_sq, and the exp_avg prediction of L2
// Adam needs the restored param (g + wd * p).

namespace superchip::ops {
namespace {

constexpr int64_t kBlock = 1024;
constexpr int kParam = 0, kExpAvg = 1, kExpAvgSq = 2, kLowp = 3;
// Code widths per field: param and exp_avg_sq take offsets -1..+1 (2 bits, 3 = exception),
// exp_avg -3..+3 (3 bits, 7 = exception: its prediction loses up to ~2 bits when the gradient
// term dominates the old moment), param_lowp one bit (0: round(param), 1: exception).
struct FieldCode {
  int shift;
  int bits;
  int64_t reach;  // largest |offset| with a code
  constexpr uint8_t exception() const { return static_cast<uint8_t>((1u << bits) - 1); }
};
constexpr FieldCode kCodes[4] = {{0, 2, 1}, {2, 3, 3}, {5, 2, 1}, {7, 1, 0}};

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
// make the prediction miss, which the exception list covers.
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

// The old param predicted from the stepped param, exp_avg and exp_avg_sq.
SUPERCHIP_UNDO_CLONES
void predict_param(const Predictor& pr, int64_t k, const float* __restrict p1, const float* __restrict m1,
                   const float* __restrict v1, float* __restrict out) {
  const float bc2 = pr.s.bc2_sqrt, eps = pr.s.eps, nss = pr.s.neg_step_size;
  const double inv_decay = pr.s.decoupled ? pr.inv_decay : 1.0;
  for (int64_t j = 0; j < k; ++j) {
    const float denom = std::sqrt(v1[j]) / bc2 + eps;
    const float upd = (nss * m1[j]) / denom;
    out[j] = static_cast<float>((static_cast<double>(p1[j]) - static_cast<double>(upd)) * inv_decay);
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
    pv[j] = snap((static_cast<double>(v1[j]) - t) * ib2, v1[j]);
  }
}

// ORs the field's code for each element into codes[]: the offset of the old value from the
// prediction in units of the last place, or the field's exception code.
SUPERCHIP_UNDO_CLONES
void encode_field(int64_t k, const float* __restrict old, const float* __restrict pred, int shift,
                  int64_t reach, uint8_t exc, uint8_t* __restrict codes) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t d = static_cast<int64_t>(ord(bits_at(old, j))) - ord(bits_at(pred, j));
    const uint64_t u = static_cast<uint64_t>(d + reach);
    const uint8_t code = u <= static_cast<uint64_t>(2 * reach) ? static_cast<uint8_t>(u) : exc;
    codes[j] = static_cast<uint8_t>(codes[j] | (code << shift));
  }
}

// The inverse of encode_field: old bits from the prediction and the code. Elements with the
// exception code get a placeholder that the caller overwrites from the exception list.
SUPERCHIP_UNDO_CLONES
void decode_field(int64_t k, const uint8_t* __restrict codes, const float* __restrict pred, int shift,
                  int64_t reach, uint8_t mask, float* __restrict out) {
  for (int64_t j = 0; j < k; ++j) {
    const int32_t code = (codes[j] >> shift) & mask;
    const uint32_t o = static_cast<uint32_t>(ord(bits_at(pred, j))) +
                       static_cast<uint32_t>(code - static_cast<int32_t>(reach));
    out[j] = bits_float(unord(static_cast<int32_t>(o)));
  }
}

SUPERCHIP_UNDO_CLONES
int64_t count_exception_codes(int64_t n, const uint8_t* __restrict codes, bool lowp) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t c = codes[i];
    count += ((c & 0x03) == 0x03) + (((c >> 2) & 0x07) == 0x07) + (((c >> 5) & 0x03) == 0x03) +
             (lowp ? (c >> 7) : 0);
  }
  return count;
}

// flags[j] != 0 when element j has an exception code in any field.
SUPERCHIP_UNDO_CLONES
void exception_flags(int64_t k, const uint8_t* __restrict codes, uint8_t* __restrict flags) {
  for (int64_t j = 0; j < k; ++j) {
    const uint8_t c = codes[j];
    flags[j] = static_cast<uint8_t>(((c & 0x03) == 0x03) | (((c >> 2) & 0x07) == 0x07) |
                                    (((c >> 5) & 0x03) == 0x03) | (c >> 7));
  }
}

void check_undo_args(const char* fn, const AdamHyper& h, const AdamArrays& a, const void* codes) {
  if (h.amsgrad) {
    throw std::invalid_argument(std::string(fn) + ": amsgrad steps cannot be undone exactly "
                                "(the running max is not invertible); step them without speculation");
  }
  if (a.n > 0 && codes == nullptr) throw std::invalid_argument(std::string(fn) + ": codes is null");
  if (a.n > kMaxUndoElements) {
    throw std::invalid_argument(std::string(fn) + ": n=" + std::to_string(a.n) + " exceeds " +
                                std::to_string(kMaxUndoElements) + " elements per call; split the arrays");
  }
}

[[noreturn]] void mismatched_log(const std::string& what) {
  throw std::invalid_argument("adam_undo: " + what + " (log and arrays do not belong together)");
}

}  // namespace

void adam_step_recording(const AdamHyper& h, const AdamArrays& a, SimdPath path, uint8_t* codes,
                         std::vector<UndoException>* exceptions) {
  check_undo_args("adam_step_recording", h, a, codes);
  detail::check_adam_args(h, a);
  const Predictor pr(detail::adam_scalars(h));
  const bool lowp = a.param_lowp != nullptr;
  float p0[kBlock], m0[kBlock], v0[kBlock], g[kBlock], pp[kBlock], pm[kBlock], pv[kBlock];
  uint16_t l0[kBlock];
  uint8_t flags[kBlock];
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

    uint8_t* cb = codes + b;
    std::memset(cb, 0, static_cast<size_t>(k));
    predict_param(pr, k, a.param + b, a.exp_avg + b, a.exp_avg_sq + b, pp);
    load_grad(a, b, k, g);
    used_grad(pr, k, g, p0);
    predict_moments(pr, k, a.exp_avg + b, a.exp_avg_sq + b, g, pm, pv);
    encode_field(k, p0, pp, kCodes[kParam].shift, kCodes[kParam].reach, kCodes[kParam].exception(), cb);
    encode_field(k, m0, pm, kCodes[kExpAvg].shift, kCodes[kExpAvg].reach, kCodes[kExpAvg].exception(), cb);
    encode_field(k, v0, pv, kCodes[kExpAvgSq].shift, kCodes[kExpAvgSq].reach, kCodes[kExpAvgSq].exception(), cb);
    if (lowp) {
      const uint8_t bit = static_cast<uint8_t>(1u << kCodes[kLowp].shift);
      if (a.lowp_dtype == DType::kBF16) {
        for (int64_t j = 0; j < k; ++j) {
          cb[j] = static_cast<uint8_t>(cb[j] | (bf16_round(bits_at(p0, j)) != l0[j] ? bit : 0));
        }
      } else {
        for (int64_t j = 0; j < k; ++j) {
          cb[j] = static_cast<uint8_t>(cb[j] | (round_lowp(p0[j], a.lowp_dtype) != l0[j] ? bit : 0));
        }
      }
    }
    // The rare elements no code describes: their old bits, in index order. The flags are
    // scanned eight at a time.
    exception_flags(k, cb, flags);
    for (int64_t j = 0; j < k; ++j) {
      if ((j & 7) == 0 && j + 8 <= k) {
        uint64_t word;
        std::memcpy(&word, flags + j, sizeof word);
        if (word == 0) {
          j += 7;
          continue;
        }
      }
      if (flags[j] == 0) continue;
      const uint8_t c = cb[j];
      const uint32_t i = static_cast<uint32_t>(b + j) << 2;
      if ((c & 0x03) == 0x03) exceptions->push_back({i | kParam, bits_at(p0, j)});
      if (((c >> 2) & 0x07) == 0x07) exceptions->push_back({i | kExpAvg, bits_at(m0, j)});
      if (((c >> 5) & 0x03) == 0x03) exceptions->push_back({i | kExpAvgSq, bits_at(v0, j)});
      if (c >> 7) exceptions->push_back({i | kLowp, l0[j]});
    }
  }
}

void adam_undo(const AdamHyper& h, const AdamArrays& a, const uint8_t* codes,
               const std::vector<UndoException>& exceptions) {
  check_undo_args("adam_undo", h, a, codes);
  detail::check_adam_args(h, a);
  const bool lowp = a.param_lowp != nullptr;
  // Checked before anything is written: the log has one exception per exception code.
  const int64_t coded = a.n > 0 ? count_exception_codes(a.n, codes, lowp) : 0;
  if (coded != static_cast<int64_t>(exceptions.size())) {
    mismatched_log("the codes name " + std::to_string(coded) + " exceptions, the log holds " +
                   std::to_string(exceptions.size()));
  }
  for (size_t e = 0; e < exceptions.size(); ++e) {
    const UndoException& x = exceptions[e];
    const FieldCode& f = kCodes[x.field()];
    if (x.index() >= a.n || (e > 0 && exceptions[e - 1].index() > x.index()) ||
        ((codes[x.index()] >> f.shift) & f.exception()) != f.exception()) {
      mismatched_log("exception " + std::to_string(e) + " (element " + std::to_string(x.index()) +
                     ", field " + std::to_string(x.field()) + ") has no matching code");
    }
  }
  const Predictor pr(detail::adam_scalars(h));
  float g[kBlock], pp[kBlock], pm[kBlock], pv[kBlock], p0[kBlock], m0[kBlock], v0[kBlock];
  uint16_t l0[kBlock];
  size_t e = 0;
  for (int64_t b = 0; b < a.n; b += kBlock) {
    const int64_t k = std::min(kBlock, a.n - b);
    const uint8_t* cb = codes + b;
    size_t e_end = e;
    while (e_end < exceptions.size() && exceptions[e_end].index() < b + k) ++e_end;
    auto fix = [&](int field, float* out) {
      for (size_t x = e; x < e_end; ++x) {
        if (exceptions[x].field() == field) out[exceptions[x].index() - b] = bits_float(exceptions[x].bits);
      }
    };
    predict_param(pr, k, a.param + b, a.exp_avg + b, a.exp_avg_sq + b, pp);
    decode_field(k, cb, pp, kCodes[kParam].shift, kCodes[kParam].reach, kCodes[kParam].exception(), p0);
    fix(kParam, p0);
    if (lowp) {
      if (a.lowp_dtype == DType::kBF16) {
        for (int64_t j = 0; j < k; ++j) l0[j] = bf16_round(bits_at(p0, j));
      } else {
        for (int64_t j = 0; j < k; ++j) l0[j] = round_lowp(p0[j], a.lowp_dtype);
      }
      for (size_t x = e; x < e_end; ++x) {
        if (exceptions[x].field() == kLowp) l0[exceptions[x].index() - b] = static_cast<uint16_t>(exceptions[x].bits);
      }
    }
    load_grad(a, b, k, g);
    used_grad(pr, k, g, p0);
    predict_moments(pr, k, a.exp_avg + b, a.exp_avg_sq + b, g, pm, pv);
    decode_field(k, cb, pm, kCodes[kExpAvg].shift, kCodes[kExpAvg].reach, kCodes[kExpAvg].exception(), m0);
    decode_field(k, cb, pv, kCodes[kExpAvgSq].shift, kCodes[kExpAvgSq].reach, kCodes[kExpAvgSq].exception(), v0);
    fix(kExpAvg, m0);
    fix(kExpAvgSq, v0);
    const size_t fb = static_cast<size_t>(k) * sizeof(float);
    std::memcpy(a.param + b, p0, fb);
    std::memcpy(a.exp_avg + b, m0, fb);
    std::memcpy(a.exp_avg_sq + b, v0, fb);
    if (lowp) std::memcpy(static_cast<uint16_t*>(a.param_lowp) + b, l0, k * sizeof(uint16_t));
    e = e_end;
  }
}

}  // namespace superchip::ops
