#include "backend/native/Rnn.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

namespace superchip::native {
namespace {

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// gates + bias, where the bias is optional (the cell is built without biases).
at::Tensor with_bias(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  return defined(bias) ? gates + *bias : gates;
}

void check_gates(const char* op, const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                 const at::Tensor& state, int64_t gates) {
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.sizes() == hidden_gates.sizes(), op,
              ": input_gates and hidden_gates must be 2-D and of one shape, got ",
              input_gates.sizes(), " and ", hidden_gates.sizes(), ".");
  TORCH_CHECK(state.dim() == 2 && state.size(0) == input_gates.size(0) &&
                  state.size(1) * gates == input_gates.size(1),
              op, ": the state must be [batch, hidden] = [", input_gates.size(0), ", ",
              input_gates.size(1) / gates, "] for gates of shape ", input_gates.sizes(), ", got ",
              state.sizes(), ".");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_decomposed(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  check_gates("_thnn_fused_lstm_cell", input_gates, hidden_gates, cx, 4);
  // The order of ATen's CPU LSTMCell: hidden gates plus input gates, each with its bias.
  const at::Tensor gates = with_bias(hidden_gates, hidden_bias) + with_bias(input_gates, input_bias);
  auto chunks = gates.chunk(4, 1);
  at::Tensor ingate = chunks[0].sigmoid();
  at::Tensor forgetgate = chunks[1].sigmoid();
  at::Tensor cellgate = chunks[2].tanh();
  at::Tensor outgate = chunks[3].sigmoid();
  at::Tensor cy = forgetgate * cx + ingate * cellgate;
  at::Tensor hy = outgate * cy.tanh();
  at::Tensor workspace = at::cat({ingate, forgetgate, cellgate, outgate}, 1);
  return {std::move(hy), std::move(cy), std::move(workspace)};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell_decomposed(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  check_gates("_thnn_fused_gru_cell", input_gates, hidden_gates, hx, 3);
  auto in = with_bias(input_gates, input_bias).chunk(3, 1);
  auto hn = with_bias(hidden_gates, hidden_bias).chunk(3, 1);
  // The order of ATen's CPU GRUCell.
  at::Tensor reset_gate = (hn[0] + in[0]).sigmoid();
  at::Tensor input_gate = (hn[1] + in[1]).sigmoid();
  at::Tensor new_gate = (in[2] + hn[2] * reset_gate).tanh();
  at::Tensor hy = (hx - new_gate) * input_gate + new_gate;
  at::Tensor workspace = at::cat({reset_gate, input_gate, new_gate, hx, hn[2]}, 1);
  return {std::move(hy), std::move(workspace)};
}

}  // namespace superchip::native
