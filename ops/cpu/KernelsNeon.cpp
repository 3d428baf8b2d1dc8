// AArch64 Advanced SIMD path (4 floats per vector); NEON is part of every AArch64 CPU, so this
// file needs no extra compiler flags.
#include <arm_neon.h>

#include "ops/cpu/StepLoop.h"

namespace superchip::ops::detail {
namespace {

struct VNeon {
  using Reg = float32x4_t;
  static constexpr int kWidth = 4;
  static Reg set1(float x) { return vdupq_n_f32(x); }
  static Reg set1_bits(uint32_t b) { return vreinterpretq_f32_u32(vdupq_n_u32(b)); }
  static Reg load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, Reg x) { vst1q_f32(p, x); }
  static Reg load_bf16(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(p)), 16));
  }
  static Reg load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static uint32x4_t is_nan(Reg x) { return vmvnq_u32(vceqq_f32(x, x)); }
  static void store_bf16(uint16_t* p, Reg x) {
    uint32x4_t u = vbslq_u32(is_nan(x), vdupq_n_u32(0x7FC00000u), vreinterpretq_u32_f32(x));
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    u = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
    vst1_u16(p, vshrn_n_u32(u, 16));
  }
  static void store_f16(uint16_t* p, Reg x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t canon = vorrq_u32(vandq_u32(u, vdupq_n_u32(0x80000000u)), vdupq_n_u32(0x7FC00000u));
    x = vreinterpretq_f32_u32(vbslq_u32(is_nan(x), canon, u));
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  static Reg add(Reg a, Reg b) { return vaddq_f32(a, b); }
  static Reg sub(Reg a, Reg b) { return vsubq_f32(a, b); }
  static Reg mul(Reg a, Reg b) { return vmulq_f32(a, b); }
  static Reg div(Reg a, Reg b) { return vdivq_f32(a, b); }
  static Reg sqrt(Reg a) { return vsqrtq_f32(a); }
  static Reg fma(Reg a, Reg b, Reg c) { return vfmaq_f32(c, a, b); }
  // Not vmaxq_f32: select exactly like the x86 paths (ties give b, a NaN in a wins).
  static Reg max_nan(Reg a, Reg b) {
    const Reg r = vbslq_f32(vcgtq_f32(a, b), a, b);
    return vbslq_f32(is_nan(a), a, r);
  }
  static Reg xor_bits(Reg a, Reg m) {
    return vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(a), vreinterpretq_u32_f32(m)));
  }
};

}  // namespace

AdamRangeFn adam_kernel_neon(DType grad, Lowp lowp) { return adam_table<VNeon>(grad, lowp); }
SgdRangeFn sgd_kernel_neon(DType grad, Lowp lowp) { return sgd_table<VNeon>(grad, lowp); }

}  // namespace superchip::ops::detail
