// scaled_dot_product_attention on superchip: the backend choice of the executor.
// F.scaled_dot_product_attention asks _fused_sdp_choice_stub which kernel to run; a device
// without a registration gets the math decomposition (bmm, softmax, bmm), slower and not the
// executor's bits. With the CPU executor the CPU's own choice is returned, so superchip runs
// _scaled_dot_product_flash_attention_for_cpu (forwarded) exactly as CPU does. With the CUDA
// executor the CUDA kernels are reachable only through the "overrideable" entry, not yet
// written, so the math path stays.
// The choice reads metadata only (shapes, strides, dtype, requires_grad), never data, so it is
// asked of the CPU's selector directly on the superchip tensors: that also works on the fake
// tensors torch.compile traces with, which have no bytes to alias.
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_native.h>

#include "backend/runtime/Runtime.h"

namespace superchip {
namespace {

int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool is_causal, std::optional<double> scale, bool enable_gqa) {
  if (executor() != Executor::kCpu) return static_cast<int64_t>(sdp::SDPBackend::math);
  return at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa);
}

}  // namespace
}  // namespace superchip

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &superchip::fused_sdp_choice)
}  // namespace at::native
