#include "backend/native/NormStats.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <unordered_map>

#include "backend/native/Forward.h"

namespace superchip::native {
namespace {

// Where an op keeps what the conversion needs: argument indices (-1: none), and the two
// statistics (outputs of a forward, arguments of a backward).
struct Spec {
  bool backward;
  bool layer_norm;
  int input;
  int weight;
  int running_mean;  // layer norm: the bias (what CPU's rule looks at after the weight)
  int running_var;
  int training;    // argument index of the flag; -1: `trains`
  bool trains;
  int eps;         // forwards in eval mode need it
  int stat0;
  int stat1;
};

const std::unordered_map<std::string, Spec>& specs() {
  static const auto* m = new std::unordered_map<std::string, Spec>{
      {"native_batch_norm", {false, false, 0, 1, 3, 4, 5, false, 7, 1, 2}},
      {"_native_batch_norm_legit", {false, false, 0, 1, 3, 4, 5, false, 7, 1, 2}},
      {"_native_batch_norm_legit.no_stats", {false, false, 0, 1, -1, -1, 3, false, 5, 1, 2}},
      {"_native_batch_norm_legit_functional", {false, false, 0, 1, 3, 4, 5, false, 7, 1, 2}},
      {"_native_batch_norm_legit_no_training", {false, false, 0, 1, 3, 4, -1, false, 6, 1, 2}},
      {"_batch_norm_with_update", {false, false, 0, 1, 3, 4, -1, true, 6, 1, 2}},
      {"_batch_norm_with_update_functional", {false, false, 0, 1, 3, 4, -1, true, 6, 1, 2}},
      {"_batch_norm_no_update", {false, false, 0, 1, 3, 4, -1, false, 6, 1, 2}},
      {"native_layer_norm", {false, true, 0, 2, 3, -1, -1, true, -1, 1, 2}},
      {"native_batch_norm_backward", {true, false, 1, 2, 3, 4, 7, false, -1, 5, 6}},
      {"batch_norm_backward", {true, false, 1, 2, 3, 4, 7, false, -1, 5, 6}},
      {"native_layer_norm_backward", {true, true, 1, 5, 6, -1, -1, true, -1, 3, 4}},
  };
  return *m;
}

bool reduced(c10::ScalarType t) { return t == c10::kBFloat16 || t == c10::kHalf; }

at::Tensor tensor_at(const torch::jit::Stack& stack, size_t base, int index) {
  if (index < 0) return at::Tensor();
  const c10::IValue& v = stack[base + index];
  return v.isTensor() ? v.toTensor() : at::Tensor();
}

// CUDA's rule: the input's compute type.
c10::ScalarType cuda_stat_type(c10::ScalarType input) { return reduced(input) ? c10::kFloat : input; }

// CPU's rule: float when a bf16/fp16 input comes with float parameters (the first defined of
// weight and running_mean for batch norm, of weight and bias for layer norm), the input's type
// otherwise.
c10::ScalarType cpu_stat_type(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& second) {
  const at::Tensor& param = weight.defined() ? weight : second;
  if (reduced(input.scalar_type()) && param.defined() && param.scalar_type() == c10::kFloat) return c10::kFloat;
  return input.scalar_type();
}

}  // namespace

const std::vector<const char*>& norm_stats_ops() {
  static const auto* names = [] {
    auto* v = new std::vector<const char*>();
    for (const auto& [name, spec] : specs()) v->push_back(name.c_str());
    return v;
  }();
  return *names;
}

void norm_stats_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  std::string name = schema.name().substr(6);
  if (!schema.overload_name().empty()) name += "." + schema.overload_name();
  const Spec& s = specs().at(name);
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  const at::Tensor input = tensor_at(*stack, base, s.input);
  const bool training = s.training >= 0 ? (*stack)[base + s.training].toBool() : s.trains;
  if (s.backward) {
    // CPU's rules back: the dtype CPU's forward would have saved; nothing in eval mode (CPU's
    // kernel reads the running statistics then).
    if (!training && !s.layer_norm) {
      (*stack)[base + s.stat0] = c10::IValue();
      (*stack)[base + s.stat1] = c10::IValue();
    } else {
      const auto type = cpu_stat_type(input, tensor_at(*stack, base, s.weight), tensor_at(*stack, base, s.running_mean));
      for (int k : {s.stat0, s.stat1}) {
        at::Tensor t = tensor_at(*stack, base, k);
        if (t.defined() && t.scalar_type() != type) (*stack)[base + k] = t.to(type);
      }
    }
    forward_to_executor(op, stack);
    return;
  }
  const at::Tensor running_mean = tensor_at(*stack, base, s.running_mean);
  const at::Tensor running_var = tensor_at(*stack, base, s.running_var);
  const double eps = s.eps >= 0 ? (*stack)[base + s.eps].toDouble() : 0.0;
  forward_to_executor(op, stack);
  const size_t outs = stack->size() - schema.returns().size();
  const auto type = cuda_stat_type(input.scalar_type());
  if (!training && !s.layer_norm && running_mean.defined() && running_var.defined()) {
    // CUDA's eval-mode statistics: the running mean and 1/sqrt(running_var + eps).
    (*stack)[outs + s.stat0] = running_mean.to(type, /*non_blocking=*/false, /*copy=*/true);
    (*stack)[outs + s.stat1] = at::rsqrt(running_var.to(type) + eps);
    return;
  }
  for (int k : {s.stat0, s.stat1}) {
    const at::Tensor t = (*stack)[outs + k].toTensor();
    if (t.scalar_type() != type) (*stack)[outs + k] = t.to(type);
  }
}

}  // namespace superchip::native
