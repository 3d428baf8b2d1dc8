// Note [Integer histc]: torch.histc of an integer tensor with the CPU executor. CUDA's histc
// takes every integer dtype (transformers' grouped_mm MoE counts tokens per expert with an
// int32 histc on any device that is not "cpu" or "mps"); CPU's takes floating types only, so
// the emulated superchip raised "histogram_cpu not implemented for 'Int'" where the GPU runs.
// With the CPU executor, integer inputs get CUDA's result, composed from forwarded operators:
// min and max truncated to the input's type, the data's extremes when they are equal (widened
// by one each way when those are equal too), elements outside [min, max] left out, bin
// (x - min) * bins / (max - min) in int64 arithmetic (the last edge in the last bin), counts
// in the input's dtype. Floating inputs forward to the executor as every operator does. With
// the CUDA executor nothing is registered (CUDA's own kernel runs).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

namespace superchip::native {

at::Tensor histc(const at::Tensor& self, int64_t bins, const c10::Scalar& min, const c10::Scalar& max);
at::Tensor& histc_out(const at::Tensor& self, int64_t bins, const c10::Scalar& min, const c10::Scalar& max,
                      at::Tensor& out);

}  // namespace superchip::native
