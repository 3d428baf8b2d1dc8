// torch.amp.autocast("superchip"): the same per-op policies as CUDA, from ATen's shared lists.
#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>
#include <torch/version.h>

#ifndef ADD_NS
#define ADD_NS(RAW_OP) at::RAW_OP
#endif

namespace {

using at::Scalar;
using at::ScalarType;
using at::Tensor;
using at::IntArrayRef;
using at::TensorList;
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
// Older torch (2.11, the GPU machine's) names DimnameList unqualified in its op lists; 2.13
// has no named-tensor entries there.
using at::DimnameList;
#endif
using at::autocast::CastPolicy;

#define SUPERCHIP_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SUPERCHIP_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SUPERCHIP_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define SUPERCHIP_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
#define SUPERCHIP_DIFFERENT_REDISPATCH(REDISPATCH_FUNC, REGISTER_NAME, REGISTER_SIGNATURE, \
                                       REDISPATCH_SIGNATURE, POLICY)                        \
  KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE(REDISPATCH_FUNC, REGISTER_NAME,       \
                                                      REGISTER_SIGNATURE, REDISPATCH_SIGNATURE, POLICY)

// CUDA's policy bans binary_cross_entropy under autocast (torch registers the ban for
// AutocastCUDA only, outside the shared lists). Without it a low-precision input met a float32
// target as "Found dtype Float but expected Half", or a low-precision target silently gave a
// half-precision loss.
Tensor binary_cross_entropy_banned(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                   int64_t) {
  TORCH_CHECK(false, "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe "
              "to autocast (torch.autocast(\"superchip\"), as on CUDA): probabilities in "
              "float16/bfloat16 lose what the log needs. Give the logits to "
              "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
              "which autocast runs in float32, or compute this loss outside the autocast region.");
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(SUPERCHIP_LOWER_PRECISION_FP)
  AT_FORALL_FP32(SUPERCHIP_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SUPERCHIP_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(SUPERCHIP_DIFFERENT_REDISPATCH)
  AT_FORALL_PROMOTE(SUPERCHIP_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
}

}  // namespace

// Ops without an autocast policy run unchanged (torch registers this for its own backends only).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}
