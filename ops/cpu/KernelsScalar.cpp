// The portable path: the generic step loop over one float at a time. std::fma keeps the
// single rounding that torch's vectorised kernels get from FMA instructions, so this path
// gives the same bits as every SIMD path.
#include <cmath>
#include <cstring>

#include "ops/cpu/LowPrecision.h"
#include "ops/cpu/StepLoop.h"

namespace superchip::ops::detail {
namespace {

struct VScalar {
  using Reg = float;
  static constexpr int kWidth = 1;
  static Reg set1(float x) { return x; }
  static Reg set1_bits(uint32_t b) { return bits_float(b); }
  static Reg load(const float* p) {
    float x;
    std::memcpy(&x, p, sizeof x);
    return x;
  }
  static void store(float* p, Reg x) { std::memcpy(p, &x, sizeof x); }
  static Reg load_bf16(const uint16_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return bf16_to_float(h);
  }
  static Reg load_f16(const uint16_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return fp16_to_float(h);
  }
  static void store_bf16(uint16_t* p, Reg x) {
    const uint16_t h = float_to_bf16(x);
    std::memcpy(p, &h, sizeof h);
  }
  static void store_f16(uint16_t* p, Reg x) {
    const uint16_t h = float_to_fp16(x);
    std::memcpy(p, &h, sizeof h);
  }
  static Reg add(Reg a, Reg b) { return a + b; }
  static Reg sub(Reg a, Reg b) { return a - b; }
  static Reg mul(Reg a, Reg b) { return a * b; }
  static Reg div(Reg a, Reg b) { return a / b; }
  static Reg sqrt(Reg a) { return std::sqrt(a); }
  static Reg fma(Reg a, Reg b, Reg c) { return std::fma(a, b, c); }
  // Same selection as x86 maxps(a, b) followed by "NaN in a wins".
  static Reg max_nan(Reg a, Reg b) {
    if (std::isnan(a)) return a;
    return a > b ? a : b;
  }
  static Reg xor_bits(Reg a, Reg m) { return bits_float(float_bits(a) ^ float_bits(m)); }
};

}  // namespace

AdamRangeFn adam_kernel_scalar(DType grad, Lowp lowp) { return adam_table<VScalar>(grad, lowp); }
SgdRangeFn sgd_kernel_scalar(DType grad, Lowp lowp) { return sgd_table<VScalar>(grad, lowp); }

}  // namespace superchip::ops::detail
