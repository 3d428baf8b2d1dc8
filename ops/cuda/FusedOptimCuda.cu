// The CUDA kernels of FusedOptimCuda.h: StepLoop.h's adam_block / sgd_block, one element per
// thread (a grid-stride loop), over VCuda below.
//
// Note [Same bits as the CPU]
// The CPU paths fix the rounding sequence (Note [Parity with torch.optim], FusedOptim.cpp):
// FMA exactly where torch has one, none elsewhere, IEEE square root and division. On the GPU
// every arithmetic step is spelled as an explicit round-to-nearest intrinsic (__fadd_rn,
// __fmaf_rn, __fsqrt_rn, __fdiv_rn, ...), which nvcc never contracts or approximates whatever
// the flags (the library is built with --fmad=false as well). Denormals are kept (no
// -ftz), as on the CPU. Widening bf16/fp16 is exact; narrowing rounds to nearest-even, and NaN
// becomes the CPU's canonical NaN (bf16 0x7FC0, fp16 sign|0x7E00) rather than CUDA's 0x7FFF.
// The per-step scalars come from the same host function (adam_scalars / sgd_scalars).
#include "ops/cuda/FusedOptimCuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "ops/cpu/StepLoop.h"

namespace superchip::ops::cuda {
namespace {

using detail::Lowp;

// StepLoop.h's vector policy for one element per thread (its kWidth, used only by the CPU's
// range loop, is not needed here).
struct VCuda {
  using Reg = float;
  __device__ static Reg set1(float x) { return x; }
  __device__ static Reg set1_bits(uint32_t b) { return __uint_as_float(b); }
  __device__ static Reg load(const float* p) { return *p; }
  __device__ static void store(float* p, Reg x) { *p = x; }
  __device__ static Reg load_bf16(const uint16_t* p) { return __uint_as_float(uint32_t{*p} << 16); }
  __device__ static Reg load_f16(const uint16_t* p) { return __half2float(__ushort_as_half(*p)); }
  __device__ static void store_bf16(uint16_t* p, Reg x) {
    if (isnan(x)) {
      *p = 0x7FC0;
      return;
    }
    const uint32_t u = __float_as_uint(x);
    *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  __device__ static void store_f16(uint16_t* p, Reg x) {
    if (isnan(x)) {
      *p = static_cast<uint16_t>(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7E00u);
      return;
    }
    *p = __half_as_ushort(__float2half_rn(x));
  }
  __device__ static Reg add(Reg a, Reg b) { return __fadd_rn(a, b); }
  __device__ static Reg sub(Reg a, Reg b) { return __fsub_rn(a, b); }
  __device__ static Reg mul(Reg a, Reg b) { return __fmul_rn(a, b); }
  __device__ static Reg div(Reg a, Reg b) { return __fdiv_rn(a, b); }
  __device__ static Reg sqrt(Reg a) { return __fsqrt_rn(a); }
  __device__ static Reg fma(Reg a, Reg b, Reg c) { return __fmaf_rn(a, b, c); }
  // The scalar path's selection: NaN in a wins, else the larger, ties give b.
  __device__ static Reg max_nan(Reg a, Reg b) {
    if (isnan(a)) return a;
    return a > b ? a : b;
  }
  __device__ static Reg xor_bits(Reg a, Reg m) {
    return __uint_as_float(__float_as_uint(a) ^ __float_as_uint(m));
  }
};

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU several times over; the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocks = 8192;

int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

__device__ inline int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <DType kG, Lowp kL>
__global__ void adam_kernel(detail::AdamScalars s, detail::AdamPtrs q, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) detail::adam_block<VCuda, kG, kL>(s, q, i);
}

template <DType kG, Lowp kL>
__global__ void sgd_kernel(detail::SgdScalars s, detail::SgdPtrs q, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) detail::sgd_block<VCuda, kG, kL>(s, q, i);
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string("superchip: CUDA launch of ") + what + " failed: " +
                           cudaGetErrorString(err));
}

Lowp lowp_of(const void* param_lowp, DType d) {
  if (param_lowp == nullptr) return Lowp::kNone;
  return d == DType::kBF16 ? Lowp::kBF16 : Lowp::kF16;
}

// Calls f(std::integral_constant<DType, g>, std::integral_constant<Lowp, l>) for the runtime pair.
template <class F>
void with_types(DType g, Lowp l, const F& f) {
  auto with_lowp = [&](auto gc) {
    switch (l) {
      case Lowp::kBF16: return f(gc, std::integral_constant<Lowp, Lowp::kBF16>{});
      case Lowp::kF16: return f(gc, std::integral_constant<Lowp, Lowp::kF16>{});
      default: return f(gc, std::integral_constant<Lowp, Lowp::kNone>{});
    }
  };
  switch (g) {
    case DType::kBF16: return with_lowp(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF16: return with_lowp(std::integral_constant<DType, DType::kF16>{});
    default: return with_lowp(std::integral_constant<DType, DType::kF32>{});
  }
}

}  // namespace

void adam_step(const AdamHyper& h, const AdamArrays& a, void* stream) {
  detail::check_adam_args(h, a);
  if (a.n == 0) return;
  const detail::AdamScalars s = detail::adam_scalars(h);
  const detail::AdamPtrs q{a.param, a.exp_avg, a.exp_avg_sq, a.max_exp_avg_sq, a.grad, a.param_lowp};
  auto st = static_cast<cudaStream_t>(stream);
  with_types(a.grad_dtype, lowp_of(a.param_lowp, a.lowp_dtype), [&](auto g, auto l) {
    adam_kernel<decltype(g)::value, decltype(l)::value><<<blocks_for(a.n), kThreads, 0, st>>>(s, q, a.n);
  });
  check_launch("adam_step");
}

void sgd_step(const SgdHyper& h, const SgdArrays& a, void* stream) {
  detail::check_sgd_args(h, a);
  if (a.n == 0) return;
  const detail::SgdScalars s = detail::sgd_scalars(h);
  const detail::SgdPtrs q{a.param, a.momentum_buffer, a.grad, a.param_lowp};
  auto st = static_cast<cudaStream_t>(stream);
  with_types(a.grad_dtype, lowp_of(a.param_lowp, a.lowp_dtype), [&](auto g, auto l) {
    sgd_kernel<decltype(g)::value, decltype(l)::value><<<blocks_for(a.n), kThreads, 0, st>>>(s, q, a.n);
  });
  check_launch("sgd_step");
}

}  // namespace superchip::ops::cuda
