// AArch64 SVE path, vector-length agnostic: the same formulas as StepLoop.h, with the tail
// (and every thread chunk's end) handled by a while-less-than predicate instead of padding.
// Built with -march=armv8-a+sve, called only when the CPU reports SVE (SimdDispatch.cpp).
#include <arm_sve.h>

#include "ops/cpu/StepKernels.h"

namespace superchip::ops::detail {
namespace {

template <DType kG>
inline svfloat32_t sve_load_grad(svbool_t pg, const void* g, int64_t i) {
  if constexpr (kG == DType::kF32) {
    return svld1_f32(pg, static_cast<const float*>(g) + i);
  } else if constexpr (kG == DType::kBF16) {
    const svuint32_t u = svld1uh_u32(pg, static_cast<const uint16_t*>(g) + i);
    return svreinterpret_f32_u32(svlsl_n_u32_x(pg, u, 16));
  } else {
    // Each fp16 sits in the low half of a 32-bit lane, where FCVT reads it.
    const svuint32_t u = svld1uh_u32(pg, static_cast<const uint16_t*>(g) + i);
    return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(u));
  }
}

template <Lowp kL>
inline void sve_store_lowp(svbool_t pg, void* d, int64_t i, svfloat32_t x) {
  if constexpr (kL == Lowp::kNone) {
    return;
  } else {
    uint16_t* dst = static_cast<uint16_t*>(d) + i;
    const svbool_t nan = svcmpuo_f32(pg, x, x);
    svuint32_t u = svreinterpret_u32_f32(x);
    if constexpr (kL == Lowp::kBF16) {
      u = svsel_u32(nan, svdup_n_u32(0x7FC00000u), u);
      const svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 1u);
      u = svadd_u32_x(pg, u, svadd_n_u32_x(pg, lsb, 0x7FFFu));
      svst1h_u32(pg, dst, svlsr_n_u32_x(pg, u, 16));
    } else {
      const svuint32_t canon = svorr_n_u32_x(pg, svand_n_u32_x(pg, u, 0x80000000u), 0x7FC00000u);
      x = svreinterpret_f32_u32(svsel_u32(nan, canon, u));
      // FCVT leaves each fp16 in the low half of its 32-bit lane; ST1H stores that half.
      svst1h_u32(pg, dst, svreinterpret_u32_f16(svcvt_f16_f32_x(pg, x)));
    }
  }
}

inline svfloat32_t sve_xor(svbool_t pg, svfloat32_t a, uint32_t m) {
  return svreinterpret_f32_u32(sveor_n_u32_x(pg, svreinterpret_u32_f32(a), m));
}

template <DType kG, Lowp kL>
void adam_range_sve(const AdamScalars& s_in, const AdamArrays& a, int64_t b, int64_t e) {
  const AdamScalars s = s_in;
  const int64_t step = static_cast<int64_t>(svcntw());
  for (int64_t i = b; i < e; i += step) {
    const svbool_t pg = svwhilelt_b32_s64(i, e);
    svfloat32_t g = sve_xor(pg, sve_load_grad<kG>(pg, a.grad, i), s.sign_mask);
    svfloat32_t p = svld1_f32(pg, a.param + i);
    if (s.decoupled) {
      p = svmul_n_f32_x(pg, p, s.decay_mul);
    } else if (s.l2) {
      g = svmla_n_f32_x(pg, g, p, s.wd);  // g + p * wd, one rounding
    }
    svfloat32_t m = svld1_f32(pg, a.exp_avg + i);
    const svfloat32_t d = svsub_f32_x(pg, g, m);
    m = svmla_n_f32_x(pg, s.lerp_small ? m : g, d, s.lerp_coef);
    svfloat32_t v = svmul_n_f32_x(pg, svld1_f32(pg, a.exp_avg_sq + i), s.beta2);
    v = svmla_f32_x(pg, v, svmul_n_f32_x(pg, g, s.one_minus_beta2), g);
    svfloat32_t vhat = v;
    if (s.amsgrad) {
      const svfloat32_t old = svld1_f32(pg, a.max_exp_avg_sq + i);
      vhat = svsel_f32(svcmpgt_f32(pg, old, v), old, v);
      vhat = svsel_f32(svcmpuo_f32(pg, old, old), old, vhat);
      svst1_f32(pg, a.max_exp_avg_sq + i, vhat);
    }
    const svfloat32_t denom =
        svadd_n_f32_x(pg, svdiv_n_f32_x(pg, svsqrt_f32_x(pg, vhat), s.bc2_sqrt), s.eps);
    const svfloat32_t num = svmul_f32_x(pg, svdup_n_f32(s.neg_step_size), m);
    p = svadd_f32_x(pg, p, svdiv_f32_x(pg, num, denom));
    svst1_f32(pg, a.param + i, p);
    svst1_f32(pg, a.exp_avg + i, m);
    svst1_f32(pg, a.exp_avg_sq + i, v);
    sve_store_lowp<kL>(pg, a.param_lowp, i, p);
  }
}

template <DType kG, Lowp kL>
void sgd_range_sve(const SgdScalars& s_in, const SgdArrays& a, int64_t b, int64_t e) {
  const SgdScalars s = s_in;
  const int64_t step = static_cast<int64_t>(svcntw());
  for (int64_t i = b; i < e; i += step) {
    const svbool_t pg = svwhilelt_b32_s64(i, e);
    svfloat32_t g = sve_xor(pg, sve_load_grad<kG>(pg, a.grad, i), s.sign_mask);
    svfloat32_t p = svld1_f32(pg, a.param + i);
    if (s.l2) g = svmla_n_f32_x(pg, g, p, s.wd);
    if (s.has_momentum) {
      svfloat32_t buf = g;
      if (!s.first_step) {
        const svfloat32_t old = svmul_n_f32_x(pg, svld1_f32(pg, a.momentum_buffer + i), s.momentum);
        buf = svmla_n_f32_x(pg, old, g, s.one_minus_dampening);
      }
      svst1_f32(pg, a.momentum_buffer + i, buf);
      g = s.nesterov ? svmla_n_f32_x(pg, g, buf, s.momentum) : buf;
    }
    p = svmla_n_f32_x(pg, p, g, s.neg_lr);
    svst1_f32(pg, a.param + i, p);
    sve_store_lowp<kL>(pg, a.param_lowp, i, p);
  }
}

template <DType kG>
AdamRangeFn adam_sve_for_grad(Lowp lowp) {
  switch (lowp) {
    case Lowp::kBF16: return &adam_range_sve<kG, Lowp::kBF16>;
    case Lowp::kF16: return &adam_range_sve<kG, Lowp::kF16>;
    default: return &adam_range_sve<kG, Lowp::kNone>;
  }
}

template <DType kG>
SgdRangeFn sgd_sve_for_grad(Lowp lowp) {
  switch (lowp) {
    case Lowp::kBF16: return &sgd_range_sve<kG, Lowp::kBF16>;
    case Lowp::kF16: return &sgd_range_sve<kG, Lowp::kF16>;
    default: return &sgd_range_sve<kG, Lowp::kNone>;
  }
}

}  // namespace

int sve_lanes() { return static_cast<int>(svcntw()); }

AdamRangeFn adam_kernel_sve(DType grad, Lowp lowp) {
  switch (grad) {
    case DType::kBF16: return adam_sve_for_grad<DType::kBF16>(lowp);
    case DType::kF16: return adam_sve_for_grad<DType::kF16>(lowp);
    default: return adam_sve_for_grad<DType::kF32>(lowp);
  }
}

SgdRangeFn sgd_kernel_sve(DType grad, Lowp lowp) {
  switch (grad) {
    case DType::kBF16: return sgd_sve_for_grad<DType::kBF16>(lowp);
    case DType::kF16: return sgd_sve_for_grad<DType::kF16>(lowp);
    default: return sgd_sve_for_grad<DType::kF32>(lowp);
  }
}

}  // namespace superchip::ops::detail
