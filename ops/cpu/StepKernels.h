// Internal to ops/cpu: the per-step constants the kernels consume and the per-path kernel
// tables. FusedOptim.cpp rounds the hyper-parameters once per call into AdamScalars /
// SgdScalars (exactly as torch.optim rounds them, see Note [Parity with torch.optim]) and
// picks a range kernel from the table of the chosen path; a range kernel steps elements
// [begin, end) of the arrays and is called once per thread chunk.
// Only the tables of the paths this build compiles are defined (SUPERCHIP_OPS_HAVE_*).
#pragma once

#include <cstdint>

#include "ops/cpu/FusedOptim.h"

namespace superchip::ops::detail {

enum class Lowp : uint8_t { kNone = 0, kBF16 = 1, kF16 = 2 };

struct AdamScalars {
  float decay_mul = 1.0f;       // 1 - lr * wd (AdamW)
  float wd = 0.0f;              // L2 coefficient (Adam)
  float lerp_coef = 0.0f;       // torch lerp: w when |w| < 0.5, else w - 1
  float beta2 = 0.0f;
  float one_minus_beta2 = 0.0f;
  float bc2_sqrt = 1.0f;        // sqrt(1 - beta2^step)
  float eps = 0.0f;
  float neg_step_size = 0.0f;   // -lr / (1 - beta1^step)
  uint32_t sign_mask = 0;       // 0x80000000 when maximizing: g = -g
  bool decoupled = false;       // AdamW decay (and wd != 0)
  bool l2 = false;              // Adam decay (and wd != 0)
  bool lerp_small = true;       // which torch lerp form: m + w*(g-m) or g + (w-1)*(g-m)
  bool amsgrad = false;
};

struct SgdScalars {
  float wd = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float neg_lr = 0.0f;
  uint32_t sign_mask = 0;
  bool l2 = false;
  bool has_momentum = false;
  bool first_step = true;
  bool nesterov = false;
};

using AdamRangeFn = void (*)(const AdamScalars& s, const AdamArrays& a, int64_t begin,
                             int64_t end);
using SgdRangeFn = void (*)(const SgdScalars& s, const SgdArrays& a, int64_t begin,
                            int64_t end);

AdamRangeFn adam_kernel_scalar(DType grad, Lowp lowp);
SgdRangeFn sgd_kernel_scalar(DType grad, Lowp lowp);
#if defined(SUPERCHIP_OPS_HAVE_AVX2)
AdamRangeFn adam_kernel_avx2(DType grad, Lowp lowp);
SgdRangeFn sgd_kernel_avx2(DType grad, Lowp lowp);
#endif
#if defined(SUPERCHIP_OPS_HAVE_AVX512)
AdamRangeFn adam_kernel_avx512(DType grad, Lowp lowp);
SgdRangeFn sgd_kernel_avx512(DType grad, Lowp lowp);
#endif
#if defined(SUPERCHIP_OPS_HAVE_NEON)
AdamRangeFn adam_kernel_neon(DType grad, Lowp lowp);
SgdRangeFn sgd_kernel_neon(DType grad, Lowp lowp);
#endif
#if defined(SUPERCHIP_OPS_HAVE_SVE)
AdamRangeFn adam_kernel_sve(DType grad, Lowp lowp);
SgdRangeFn sgd_kernel_sve(DType grad, Lowp lowp);
int sve_lanes();  // svcntw(): call only when the CPU has SVE
#endif

// The per-step constants of `h`, rounded once as torch.optim rounds them (ops/cuda uses them
// too, so both devices start from the same fp32 scalars).
AdamScalars adam_scalars(const AdamHyper& h);
SgdScalars sgd_scalars(const SgdHyper& h);

// Argument checks shared by the kernels and the references; throw std::invalid_argument.
void check_adam_args(const AdamHyper& h, const AdamArrays& a);
void check_sgd_args(const SgdHyper& h, const SgdArrays& a);

}  // namespace superchip::ops::detail
