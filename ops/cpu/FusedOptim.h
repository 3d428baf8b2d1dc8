// Fused CPU optimizer steps: one pass over memory per call, torch-free.
// Each step reads the gradient (fp32/bf16/fp16), updates the fp32 parameter (the model's own
// fp32 parameter or the fp32 master of a low-precision one) and its state in place, and,
// when `param_lowp` is given, writes the updated parameter rounded (nearest-even) to bf16/fp16
// in the same pass. The arithmetic follows torch.optim's single-tensor (foreach=False)
// formulas in fp32, rounding like torch's CPU kernels: see Note [Parity with torch.optim] in
// FusedOptim.cpp. Every SIMD path gives the same bits as the scalar path. n == 0 is a no-op;
// pointers need no alignment; arrays must not overlap.
// Thread-safety: calls on disjoint arrays may run concurrently; `pool` may be shared.
#pragma once

#include <cstdint>
#include <string>

namespace superchip::ops {

class ThreadPool;

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
const char* dtype_name(DType d) noexcept;

enum class SimdPath : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3, kSve = 4 };
const char* simd_path_name(SimdPath p) noexcept;
// Best path this CPU supports, unless SUPERCHIP_SIMD=scalar|avx2|avx512|neon|sve forces one
// (forcing a path the CPU or the build lacks throws std::invalid_argument naming both; an
// unknown value throws too). The variable is read on every call.
SimdPath active_simd_path();
// Whether this build has `p` and this CPU (and OS) can run it. kScalar is always supported.
bool simd_path_supported(SimdPath p) noexcept;
// The best supported path, ignoring SUPERCHIP_SIMD.
SimdPath best_simd_path() noexcept;
// fp32 lanes per vector of `p` on this CPU (SVE: the CPU's vector length), 0 if unsupported.
int simd_path_width(SimdPath p) noexcept;
// The CPU's model name as the OS or CPUID reports it, plus the ISA features the paths need,
// e.g. "AMD EPYC 9R14 (x86-64: avx2 fma f16c avx512f)". For messages and `superchip info`.
std::string cpu_description();

// Hyper-parameters are double, like the Python floats torch.optim computes its per-step
// scalars from (1 - beta1, lr * weight_decay, beta**step, lr / bias_correction1 in double,
// then rounded to fp32); a float field would already differ from torch (1 - 0.9f != 1 - 0.9).
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = false;  // true: AdamW (p *= 1 - lr*wd); false: Adam (g += wd*p)
  bool amsgrad = false;                  // needs max_exp_avg_sq
  bool maximize = false;
  int64_t step = 1;                      // the step number after increment (>= 1)
};

struct AdamArrays {
  float* param = nullptr;            // fp32 parameter or fp32 master, updated in place
  float* exp_avg = nullptr;          // first moment, fp32
  float* exp_avg_sq = nullptr;       // second moment, fp32
  float* max_exp_avg_sq = nullptr;   // amsgrad only, fp32
  const void* grad = nullptr;        // gradient of dtype grad_dtype
  DType grad_dtype = DType::kF32;
  void* param_lowp = nullptr;        // optional low-precision copy written after the update
  DType lowp_dtype = DType::kBF16;   // kBF16 or kF16
  int64_t n = 0;                     // elements in every array
};

// Runs on `path` (must be supported, else std::invalid_argument); with a pool, the range is
// split across its threads at 64-byte boundaries of `param` (under 64Ki elements it runs on
// the calling thread). Results do not depend on the path, the pool or the alignment. Invalid arguments (n < 0, a missing array, step < 1,
// amsgrad without max_exp_avg_sq, a lowp dtype other than bf16/f16) throw
// std::invalid_argument before anything is written.
void adam_step(const AdamHyper& h, const AdamArrays& a, SimdPath path, ThreadPool* pool = nullptr);
// Readable reference computing in double, rounding to the storage types at the end.
void adam_step_ref(const AdamHyper& h, const AdamArrays& a);

struct SgdHyper {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
  bool first_step = true;  // momentum buffer is initialised to the gradient on the first step
};

struct SgdArrays {
  float* param = nullptr;
  float* momentum_buffer = nullptr;  // required when momentum != 0, else ignored
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* param_lowp = nullptr;
  DType lowp_dtype = DType::kBF16;
  int64_t n = 0;
};

// Same contract as adam_step (missing momentum_buffer with momentum != 0 throws).
void sgd_step(const SgdHyper& h, const SgdArrays& a, SimdPath path, ThreadPool* pool = nullptr);
void sgd_step_ref(const SgdHyper& h, const SgdArrays& a);

}  // namespace superchip::ops
