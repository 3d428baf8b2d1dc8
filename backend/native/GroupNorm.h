// Note [GroupNorm layouts]: native_group_norm and its backward with the CPU executor.
// torch's autograd formula passes the backward its gradient and input made contiguous in the
// input's suggested memory format on a CPU tensor, but in the plain (NCHW) format on any other
// device. The CPU kernel reduces in a different order for each format, so a channels-last
// GroupNorm on superchip would get gradients a few ulps from CPU's. The forward records, for
// an input that suggests a channels-last format, that format under the storage of its `rstd`
// output (which the backward receives); the backward restores it before running the CPU
// kernel. Same bits and strides as CPU. With the CUDA executor nothing is registered (CUDA's
// formula uses the plain format too). Thread-safety: any thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <tuple>

namespace superchip::native {

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_group_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    c10::SymInt N, c10::SymInt C, c10::SymInt HxW, int64_t group, double eps);

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_group_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, c10::SymInt N, c10::SymInt C, c10::SymInt HxW, int64_t group,
    std::array<bool, 3> output_mask);

}  // namespace superchip::native
