// Note [Norm statistics]: batch and layer norm with the CPU executor. CPU's kernels save their
// statistics for the backward (native_batch_norm's save_mean/save_invstd, native_layer_norm's
// mean/rstd) by CPU's rules: empty in eval mode, and in bf16/fp16 for a bf16/fp16 input (float
// when the parameters are float). PyTorch's FakeTensor, meta kernels and decompositions give
// every device but "cpu" CUDA's rules: [C] in eval mode (running_mean, 1/sqrt(running_var +
// eps)) and float for bf16/fp16 inputs; the CUDA executor's kernels follow them too. So a fake
// trace on superchip predicted other shapes and dtypes than eager gave (found by PyTorch's
// test_decomp on superchip). The forwards below return CUDA's rules; the backwards give CPU's
// kernels CPU's rules back (they check the dtypes: statistics rounded from float to bf16 and
// widened again give back the same bf16, so gradients keep CPU's bits). With the CUDA executor
// nothing is registered. Thread-safety: any thread.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <vector>

namespace superchip::native {

// Schema names ("aten::op.overload" without "aten::") of the ops norm_stats_kernel handles.
const std::vector<const char*>& norm_stats_ops();

// Boxed kernel for every op of norm_stats_ops(): forwards to the executor with the statistics
// converted as Note [Norm statistics] says.
void norm_stats_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace superchip::native
