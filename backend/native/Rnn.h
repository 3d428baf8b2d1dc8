// Note [Fused RNN cells]: the fused RNN cells with the CPU executor. ATen's LSTM/GRU cells take the fused path
// (_thnn_fused_lstm_cell, _thnn_fused_gru_cell) for every non-CPU input; the CPU has no
// kernel for them. With the CPU executor these decompositions, registered to
// AutogradPrivateUse1, compute the same cell with differentiable ops (autograd derives their
// backward). With the CUDA executor nothing is registered and CUDA's fused kernels run.
// Outputs and workspace layouts are those of the CUDA kernels (see Rnn.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace superchip::native {

// (hy, cy, workspace[N, 4H] = activated gates i, f, g, o)
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_decomposed(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias);
// (hy, workspace[N, 5H] = r, z, n, hx, hidden n-gate + its bias)
std::tuple<at::Tensor, at::Tensor> fused_gru_cell_decomposed(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias);

}  // namespace superchip::native
