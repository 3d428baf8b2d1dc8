// Fused Adam/AdamW/SGD steps on a CUDA GPU, torch-free and CUDA-free in this header: the
// contract of ops/cpu's adam_step / sgd_step (FusedOptim.h) with device-addressable arrays
// (cudaMalloc'd memory, or host memory registered with CUDA) enqueued on `stream`, a
// cudaStream_t (nullptr: the legacy default stream). The call returns once the kernel is
// enqueued. Results are bit for bit those of the CPU kernels: the per-element body is the same
// code (StepLoop.h) over CUDA's correctly rounded intrinsics, from the same fp32 scalars.
// n == 0 enqueues nothing. Invalid arguments throw std::invalid_argument before anything is
// enqueued; a failed launch throws std::runtime_error naming the CUDA error.
// Only built with a CUDA toolkit (SUPERCHIP_HAVE_OPS_CUDA); thread-safety is CUDA's.
#pragma once

#include "ops/cpu/FusedOptim.h"

namespace superchip::ops::cuda {

void adam_step(const AdamHyper& h, const AdamArrays& a, void* stream);
void sgd_step(const SgdHyper& h, const SgdArrays& a, void* stream);

}  // namespace superchip::ops::cuda
