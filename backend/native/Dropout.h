// Note [Dropout on the CPU executor]: ATen's dropout (CompositeImplicitAutograd) takes the fused
// path, native_dropout, for CUDA, XPU and PrivateUse1 inputs, and the composite one
// (noise = bernoulli(1-p) / (1-p); input * noise) for CPU inputs. The two draw the same mask
// but round differently in bfloat16/float16: native_dropout scales by a float 1/(1-p), the
// composite by noise rounded to the input's dtype, so a low-precision model's dropout (LoRA's
// lora_dropout, attention and residual dropout) gave other bits than the CPU: its gradient
// differed on about one element in ten. With the CPU executor this kernel, registered to
// AutogradPrivateUse1, runs the CPU's composite (autograd records its ops as on the CPU); with
// the CUDA executor nothing is registered and CUDA's fused kernel runs, as on CUDA. A traced
// graph (torch.compile, make_fx) would take this kernel before torch's Python decomposition,
// which a CPU model's graph takes (native_dropout, `rand > p`: the complement of this kernel's
// mask in compiled code); superchip/_inductor/patches.py (point 12) gives superchip the
// decomposition while tracing, so compiled superchip gives compiled CPU's bits.
#pragma once

#include <ATen/core/Tensor.h>

namespace superchip::native {

at::Tensor dropout_as_on_cpu(const at::Tensor& input, double p, bool train);

}  // namespace superchip::native
