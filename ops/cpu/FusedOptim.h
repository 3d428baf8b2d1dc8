// Fused CPU optimizer steps: one pass over memory per call, torch-free.
// Each step reads the gradient (fp32/bf16/fp16), updates the fp32 parameter (the model's own
// fp32 parameter or the fp32 master of a low-precision one) and its state in place, and,
// when `param_lowp` is given, writes the updated parameter rounded (nearest-even) to bf16/fp16
// in the same pass. The arithmetic follows torch.optim's single-tensor (foreach=False)
// formulas in fp32. n == 0 is a no-op; pointers need no alignment; arrays must not overlap.
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
// (forcing a path the CPU or the build lacks throws std::invalid_argument naming both).
SimdPath active_simd_path();
bool simd_path_supported(SimdPath p) noexcept;

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;  // true: AdamW (p *= 1 - lr*wd); false: Adam (g += wd*p)
  bool amsgrad = false;                  // needs max_exp_avg_sq
  bool maximize = false;
  int64_t step = 1;                      // the step number after increment (1 on the first step)
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
  int64_t n = 0;
};

// Runs on `path` (must be supported); with a pool, the range is split across its threads.
void adam_step(const AdamHyper& h, const AdamArrays& a, SimdPath path, ThreadPool* pool = nullptr);
// Readable reference computing in double, rounding to the storage types at the end.
void adam_step_ref(const AdamHyper& h, const AdamArrays& a);

struct SgdHyper {
  float lr = 1e-3f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool maximize = false;
  bool first_step = true;  // momentum buffer is initialised to the gradient on the first step
};

struct SgdArrays {
  float* param = nullptr;
  float* momentum_buffer = nullptr;  // required when momentum != 0
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* param_lowp = nullptr;
  DType lowp_dtype = DType::kBF16;
  int64_t n = 0;
};

void sgd_step(const SgdHyper& h, const SgdArrays& a, SimdPath path, ThreadPool* pool = nullptr);
void sgd_step_ref(const SgdHyper& h, const SgdArrays& a);

}  // namespace superchip::ops
