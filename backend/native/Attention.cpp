// scaled_dot_product_attention on superchip: the backend choice of the executor.
// F.scaled_dot_product_attention asks _fused_sdp_choice_stub which kernel to run; a device
// without a registration gets the math decomposition (bmm, softmax, bmm), slower and not the
// executor's bits. With the CPU executor the CPU's own choice is returned, so superchip runs
// _scaled_dot_product_flash_attention_for_cpu (forwarded) exactly as CPU does. With the CUDA
// executor the CUDA kernels are reachable only through the "overrideable" entry, not yet
// written, so the math path stays.
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice.h>

#include "backend/native/Forward.h"
#include "backend/runtime/Runtime.h"

namespace superchip {
namespace {

// The executor's choice depends on which inputs require grad (a kernel not differentiable in
// the mask is not chosen for a mask that requires grad); an alias has no autograd meta, so it
// is marked like the original.
at::Tensor choice_alias(const at::Tensor& t) {
  at::Tensor a = executor_alias(t, Access::kRead);
  if (t.requires_grad()) a.requires_grad_(true);
  return a;
}

int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool is_causal, std::optional<double> scale, bool enable_gqa) {
  if (executor() != Executor::kCpu) return static_cast<int64_t>(sdp::SDPBackend::math);
  std::optional<at::Tensor> mask;
  if (attn_mask.has_value() && attn_mask->defined()) mask = choice_alias(*attn_mask);
  return at::_fused_sdp_choice(choice_alias(query), choice_alias(key), choice_alias(value), mask,
                               dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace
}  // namespace superchip

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &superchip::fused_sdp_choice)
}  // namespace at::native
