// Forwarding superchip operators to the executor (see DESIGN.md "Executing operators").
// A superchip tensor is *aliased* as an executor tensor over the same bytes (no copy); the
// executor's kernel runs; each result is *re-tagged* as a superchip tensor: a view of an
// input keeps that input's superchip storage, a fresh result is adopted and accounted in hbm.
// Thread-safety: stateless apart from a thread-local cache of per-operator facts.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace superchip {

// An executor tensor over the bytes of superchip tensor `t` (same sizes, strides, offset,
// dtype, conj/neg bits). It keeps t's storage alive. Undefined in, undefined out.
at::Tensor executor_alias(const at::Tensor& t);
// A superchip tensor for executor result `r`: shares the superchip storage when `r` views an
// alias, otherwise adopts r's memory into superchip:device (accounted in hbm).
at::Tensor retag_result(const at::Tensor& r, c10::DeviceIndex device);

// The boxed fallback registered for every aten op without a native superchip kernel.
void forward_to_executor(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace superchip
