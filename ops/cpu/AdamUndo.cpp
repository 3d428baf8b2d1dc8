#include "ops/cpu/AdamUndo.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

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
  uint8_t exception() const { return static_cast<uint8_t>((1u << bits) - 1); }
};
constexpr FieldCode kCodes[4] = {{0, 2, 1}, {2, 3, 3}, {5, 2, 1}, {7, 1, 0}};

// A monotone map of float bits to integers that keeps -0 and +0 apart.
int64_t ord(uint32_t bits) {
  return (bits & 0x80000000u) ? -static_cast<int64_t>(bits & 0x7FFFFFFFu) - 1
                              : static_cast<int64_t>(bits);
}

uint32_t unord(int64_t o) {
  return o >= 0 ? static_cast<uint32_t>(o) : (static_cast<uint32_t>(-(o + 1)) | 0x80000000u);
}

float grad_at(const AdamArrays& a, int64_t i) {
  switch (a.grad_dtype) {
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(a.grad)[i]);
    case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(a.grad)[i]);
    default: return static_cast<const float*>(a.grad)[i];
  }
}

uint16_t round_lowp(float x, DType d) {
  return d == DType::kBF16 ? float_to_bf16(x) : float_to_fp16(x);
}

// Snaps a prediction to zero when it is rounding residue of the terms it came from.
float snap(double pred, double scale) {
  return std::fabs(pred) <= std::ldexp(std::fabs(scale), -21) ? 0.0f : static_cast<float>(pred);
}

struct Predictor {
  detail::AdamScalars s;

  float param(float p1, float m1, float v1) const {
    const float denom = std::sqrt(v1) / s.bc2_sqrt + s.eps;
    const float upd = (s.neg_step_size * m1) / denom;
    double p0 = static_cast<double>(p1) - static_cast<double>(upd);
    if (s.decoupled) p0 /= static_cast<double>(s.decay_mul);
    return static_cast<float>(p0);
  }
  // The gradient as the kernel used it: sign flipped when maximizing, L2 term added.
  float grad(float g, float p0) const {
    float gs = bits_float(float_bits(g) ^ s.sign_mask);
    if (s.l2) gs = std::fmaf(p0, s.wd, gs);
    return gs;
  }
  float exp_avg(float m1, float g) const {
    const double c = s.lerp_coef;
    const double pred = s.lerp_small ? (static_cast<double>(m1) - c * g) / (1.0 - c)
                                     : ((1.0 + c) * g - static_cast<double>(m1)) / c;
    return snap(pred, std::fmax(std::fabs(static_cast<double>(m1)), std::fabs(c * g)));
  }
  float exp_avg_sq(float v1, float g) const {
    const double t = static_cast<double>(s.one_minus_beta2 * g) * static_cast<double>(g);
    return snap((static_cast<double>(v1) - t) / static_cast<double>(s.beta2), v1);
  }
};

// The field's code, already shifted into its place in the element's byte.
uint8_t code_of(uint32_t old_bits, float pred, int field, int64_t index,
                std::vector<UndoException>* exc) {
  const FieldCode& f = kCodes[field];
  const int64_t d = ord(old_bits) - ord(float_bits(pred));
  if (d >= -f.reach && d <= f.reach) return static_cast<uint8_t>((d + f.reach) << f.shift);
  exc->push_back({static_cast<uint32_t>(index) << 2 | static_cast<uint32_t>(field), old_bits});
  return static_cast<uint8_t>(f.exception() << f.shift);
}

// The old value of `field` at `index`: from its code, or from the exception list, whose
// entries for `index` start at `first` (the list is sorted by index, fields in any order).
uint32_t restore(uint8_t byte, float pred, int field, int64_t index,
                 const std::vector<UndoException>& exc, size_t first) {
  const FieldCode& f = kCodes[field];
  const uint8_t code = static_cast<uint8_t>((byte >> f.shift) & f.exception());
  if (code != f.exception()) return unord(ord(float_bits(pred)) + code - f.reach);
  for (size_t k = first; k < exc.size() && exc[k].index() == index; ++k) {
    if (exc[k].field() == field) return exc[k].bits;
  }
  throw std::invalid_argument("adam_undo: the undo log has no exception for element " +
                              std::to_string(index) + " field " + std::to_string(field) +
                              " (log and arrays do not belong together)");
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

}  // namespace

void adam_step_recording(const AdamHyper& h, const AdamArrays& a, SimdPath path, uint8_t* codes,
                         std::vector<UndoException>* exceptions) {
  check_undo_args("adam_step_recording", h, a, codes);
  detail::check_adam_args(h, a);
  const Predictor pr{detail::adam_scalars(h)};
  const bool lowp = a.param_lowp != nullptr;
  float p0[kBlock], m0[kBlock], v0[kBlock];
  uint16_t l0[kBlock];
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
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = b + j;
      const float p1 = a.param[i], m1 = a.exp_avg[i], v1 = a.exp_avg_sq[i];
      uint8_t c = code_of(float_bits(p0[j]), pr.param(p1, m1, v1), kParam, i, exceptions);
      const float g = pr.grad(grad_at(a, i), p0[j]);
      c |= code_of(float_bits(m0[j]), pr.exp_avg(m1, g), kExpAvg, i, exceptions);
      c |= code_of(float_bits(v0[j]), pr.exp_avg_sq(v1, g), kExpAvgSq, i, exceptions);
      if (lowp && round_lowp(p0[j], a.lowp_dtype) != l0[j]) {
        exceptions->push_back({static_cast<uint32_t>(i) << 2 | kLowp, l0[j]});
        c |= static_cast<uint8_t>(kCodes[kLowp].exception() << kCodes[kLowp].shift);
      }
      codes[i] = c;
    }
  }
}

void adam_undo(const AdamHyper& h, const AdamArrays& a, const uint8_t* codes,
               const std::vector<UndoException>& exceptions) {
  check_undo_args("adam_undo", h, a, codes);
  detail::check_adam_args(h, a);
  const Predictor pr{detail::adam_scalars(h)};
  size_t k = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    const uint8_t c = codes[i];
    while (k < exceptions.size() && exceptions[k].index() < i) ++k;
    const float p1 = a.param[i], m1 = a.exp_avg[i], v1 = a.exp_avg_sq[i];
    const float p0 = bits_float(restore(c, pr.param(p1, m1, v1), kParam, i, exceptions, k));
    if (a.param_lowp != nullptr) {
      auto* lp = static_cast<uint16_t*>(a.param_lowp);
      lp[i] = (c >> kCodes[kLowp].shift) & 1
                  ? static_cast<uint16_t>(restore(c, 0.0f, kLowp, i, exceptions, k))
                  : round_lowp(p0, a.lowp_dtype);
    }
    const float g = pr.grad(grad_at(a, i), p0);
    a.exp_avg[i] = bits_float(restore(c, pr.exp_avg(m1, g), kExpAvg, i, exceptions, k));
    a.exp_avg_sq[i] = bits_float(restore(c, pr.exp_avg_sq(v1, g), kExpAvgSq, i, exceptions, k));
    a.param[i] = p0;
  }
}

}  // namespace superchip::ops
