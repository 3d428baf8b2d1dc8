// Note [Attention on superchip]: scaled_dot_product_attention runs the executor's own kernel.
// F.scaled_dot_product_attention asks _fused_sdp_choice_stub, for the query's device type,
// which kernel to run. superchip's answer is the executor's selector asked on stand-ins of the
// executor's device type (same metadata, no bytes: the selectors read metadata only, and
// torch.compile asks with fake tensors). The CPU's flash choice runs
// _scaled_dot_product_flash_attention_for_cpu; CUDA's efficient and cuDNN choices are
// device-generic branches of sdpa. All are forwarded. CUDA's flash kernel is reachable from a
// non-CUDA device only through the "overrideable" branch, so that choice is answered
// `overrideable`, and the two kernels below (registered with the CUDA executor, and in the
// emulation below) run CUDA's flash forward and backward with the head-dim padding sdpa
// applies on CUDA: the bits of plain CUDA. Thread-safety: any thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <tuple>

namespace superchip::native {

// Whether CUDA's flash choice is answered `overrideable` and the kernels below are registered:
// with the CUDA executor, or with the CPU executor under SUPERCHIP_EMULATE_CUDA_FLASH=1 (Note
// [Emulating CUDA's flash entry], Attention.cpp), which tests this path without a GPU.
bool flash_through_overrideable();

// (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
// debug_attn_mask), as _scaled_dot_product_flash_attention returns them; attn_bias must be
// absent (flash attention takes no mask; sdpa never passes one here).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
           at::Tensor, at::Tensor>
sdpa_overrideable_flash(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& attn_bias, double dropout_p,
                        bool is_causal, bool return_debug_mask, std::optional<double> scale);

// (grad_query, grad_key, grad_value, undefined grad_attn_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_overrideable_flash_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask,
    const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& cum_seq_q,
    const at::Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k, double dropout_p,
    bool is_causal, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    std::optional<double> scale);

}  // namespace superchip::native
