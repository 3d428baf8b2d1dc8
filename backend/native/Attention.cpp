// Note [Attention on superchip] (Attention.h): the backend choice, and CUDA's flash kernel
// through the "overrideable" entry.
#include "backend/native/Attention.h"

#include <ATen/Functions.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#include "backend/runtime/Runtime.h"

namespace superchip::native {
namespace {

// ---- the choice ----

// Stand-ins are never read. Their address: superchip's blocks are at least 64-byte aligned
// (allocator/Backing.h), past any base-pointer alignment a selector asks for (16 bytes for
// CUDA's memory-efficient kernel), so only the storage offset decides, as for the real tensor.
void* const kUnreadAddress = reinterpret_cast<void*>(uintptr_t{1} << 12);

// A tensor of the executor's device type with `t`'s sizes, strides, offset, dtype and
// requires_grad over a storage that owns nothing. `t`'s own bytes are never touched: a fake
// tensor has none, and some storages refuse even to tell their address.
at::Tensor executor_standin(const at::Tensor& t) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(kUnreadAddress, executor_device(t.device().index())),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage),
                                                   c10::DispatchKeySet(executor_dispatch_key()), t.dtype());
  impl->set_sizes_and_strides(t.sym_sizes(), t.sym_strides(), t.sym_storage_offset());
  at::Tensor s(std::move(impl));
  if (t.requires_grad()) s.set_requires_grad(true);
  return s;
}

int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool is_causal, std::optional<double> scale, bool enable_gqa) {
  const bool mask = attn_mask.has_value() && attn_mask->defined();
  if (query.is_nested() || key.is_nested() || value.is_nested() || (mask && attn_mask->is_nested())) {
    // Nested inputs: the CPU's selector reads only metadata a nested tensor answers for any
    // device; CUDA's nested flash path is not wired through superchip, so math.
    if (executor() == Executor::kCuda) return static_cast<int64_t>(sdp::SDPBackend::math);
    return at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                             enable_gqa);
  }
  std::optional<at::Tensor> mask_standin;
  if (mask) mask_standin = executor_standin(*attn_mask);
  // The executor's selector, as its kernel of the _fused_sdp_choice op: a redispatch to that
  // key alone, so no mode on the stack (fake tensors while compiling) sees the stand-ins.
  const int64_t choice = at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(executor_dispatch_key()), executor_standin(query), executor_standin(key),
      executor_standin(value), mask_standin, dropout_p, is_causal, scale, enable_gqa);
  // sdpa runs CUDA's flash kernel only for CUDA tensors; the overrideable entry reaches it.
  if (flash_through_overrideable() && choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention)) {
    return static_cast<int64_t>(sdp::SDPBackend::overrideable);
  }
  return choice;
}

// ---- CUDA's flash kernel through the overrideable entry ----

// sdpa pads the head dimension of q, k and v to a multiple of 8 before CUDA's flash kernel
// (pad_last_dim<8, false> in ATen's attention.cpp) and narrows the output after it; autograd
// then pads the output's gradient with zeros and narrows the inputs' gradients. Done here
// below autograd, the kernel sees the same bytes: the padded columns of the output are zeros
// (P times zero columns of V), as the zero-padded `out` passed to the backward.
at::Tensor pad_head_dim(const at::Tensor& t) {
  const int64_t d = t.size(-1);
  if (d % 8 == 0) return t;
  return at::constant_pad_nd(t, {0, 8 - d % 8}, 0);
}

// `padded` narrowed back to `like`'s head dimension, in `like`'s layout (the layout the
// overrideable ops' meta functions promise, which torch.compile checks).
at::Tensor unpad_like(const at::Tensor& padded, const at::Tensor& like) {
  if (padded.size(-1) == like.size(-1)) return padded;
  at::Tensor r = at::empty_like(like);
  r.copy_(padded.narrow(-1, 0, like.size(-1)));
  return r;
}

// Note [Flash's random state through the overrideable entry]
// CUDA's flash kernel returns its dropout state as one uint64 tensor of two words (seed,
// offset) and an unused uint64 scalar (older versions: two int64 scalars). The overrideable
// entry's meta function, which torch.compile checks outputs against, promises two 0-dim
// tensors. So the two words leave as 0-dim int64 views of that one tensor, and the backward
// finds them (adjacent views of one storage) and hands the kernel its two-word view again:
// the same bytes, no copy. The scalar form passes through unchanged both ways.
std::pair<at::Tensor, at::Tensor> rng_state_to_entry(const at::Tensor& seed, const at::Tensor& offset) {
  if (seed.defined() && seed.dim() == 1 && seed.numel() == 2 && seed.element_size() == 8) {
    at::Tensor words = seed.view(at::kLong);
    return {words.select(0, 0), words.select(0, 1)};
  }
  return {seed, offset};
}

std::pair<at::Tensor, at::Tensor> rng_state_from_entry(const at::Tensor& seed, const at::Tensor& offset) {
  const bool two_words = seed.defined() && offset.defined() && seed.dim() == 0 && offset.dim() == 0 &&
                         seed.scalar_type() == at::kLong && offset.scalar_type() == at::kLong &&
                         seed.has_storage() && offset.has_storage() &&
                         seed.storage().is_alias_of(offset.storage()) &&
                         offset.storage_offset() == seed.storage_offset() + 1;
  if (!two_words) return {seed, offset};
  // The forward's second output was never read; an uninitialised scalar of its type.
  return {seed.as_strided({2}, {1}).view(at::kUInt64), at::empty({}, seed.options().dtype(at::kUInt64))};
}

void check_flash_entry(const char* op, bool has_bias) {
  TORCH_CHECK(!has_bias, op, " on superchip runs CUDA's flash-attention kernel, which takes no attn_bias, "
              "and one was given. Call torch.nn.functional.scaled_dot_product_attention with the mask: it "
              "picks a kernel that takes one.");
}

}  // namespace

// Note [Emulating CUDA's flash entry]
// The kernels below run only with the CUDA executor, where nothing in CI runs. With
// SUPERCHIP_EMULATE_CUDA_FLASH=1 the CPU executor takes them too: the CPU's flash choice is
// answered `overrideable`, and these kernels call _scaled_dot_product_flash_attention and its
// backward, forwarded to the CPU, which has no kernel for them. The test that sets the
// variable (test_attention.py) registers CPU kernels for both with torch.library, standing in
// for CUDA's flash kernel, and checks the result against sdpa's CUDA flash branch written out
// over the same stand-ins: padding, scale, narrowing and the autograd wiring, bit for bit.
// Test-only; anything else that runs attention under it fails for want of those kernels.
bool flash_through_overrideable() {
  static const bool emulate = [] {
    const char* v = std::getenv("SUPERCHIP_EMULATE_CUDA_FLASH");
    return v != nullptr && std::string(v) == "1";
  }();
  return executor() == Executor::kCuda || emulate;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
           at::Tensor, at::Tensor>
sdpa_overrideable_flash(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& attn_bias, double dropout_p,
                        bool is_causal, bool return_debug_mask, std::optional<double> scale) {
  check_flash_entry("_scaled_dot_product_fused_attention_overrideable", attn_bias.has_value() && attn_bias->defined());
  // The scale of the unpadded head dimension, as sdpa computes it.
  const double og_scale = sdp::calculate_scale(query, scale).guard_float(__FILE__, __LINE__);
  auto [out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, debug_mask] =
      at::_scaled_dot_product_flash_attention(pad_head_dim(query), pad_head_dim(key), pad_head_dim(value),
                                              dropout_p, is_causal, return_debug_mask, og_scale);
  auto [entry_seed, entry_offset] = rng_state_to_entry(seed, offset);
  // Flash attention requires q, k and v to share their head dimension (the selector checks).
  return {unpad_like(out, query), logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
          entry_seed, entry_offset, debug_mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_overrideable_flash_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> /*grad_input_mask*/,
    const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& cum_seq_q,
    const at::Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k, double dropout_p,
    bool is_causal, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    std::optional<double> scale) {
  check_flash_entry("_scaled_dot_product_fused_attention_overrideable_backward", attn_bias.defined());
  const double og_scale = sdp::calculate_scale(query, scale).guard_float(__FILE__, __LINE__);
  auto [seed, offset] = rng_state_from_entry(philox_seed, philox_offset);
  // Every gradient is computed, whatever grad_input_mask says, as CUDA's flash backward does.
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_backward_symint(
      pad_head_dim(grad_out), pad_head_dim(query), pad_head_dim(key), pad_head_dim(value),
      pad_head_dim(out), logsumexp, cum_seq_q, cum_seq_k, std::move(max_q), std::move(max_k),
      dropout_p, is_causal, seed, offset, og_scale);
  return {unpad_like(gq, query), unpad_like(gk, key), unpad_like(gv, value), at::Tensor()};
}

}  // namespace superchip::native

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &superchip::native::fused_sdp_choice)
}  // namespace at::native
