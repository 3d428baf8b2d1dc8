// ops/cuda's fused steps against ops/cpu's scalar path, bit for bit: every grad x lowp dtype,
// Adam / L2 / AdamW / amsgrad / maximize / both lerp forms, SGD with and without momentum,
// nesterov, dampening; sizes around the block size and a large one; first and later steps;
// NaN, infinities, signed zeros and denormals; operands in device memory and in mapped
// pinned host memory (what the host tier is with the CUDA executor). Skipped, saying so,
// where no CUDA device is visible: it runs on the GPU machine.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops_test_util.h"
#include "ops/cuda/FusedOptimCuda.h"

namespace superchip::ops::test {
namespace {

bool have_device(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *why = std::string("no CUDA device: ") + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    *why = "no CUDA device visible";
    return false;
  }
  return true;
}

#define SUPERCHIP_SKIP_WITHOUT_GPU()                    \
  do {                                                  \
    std::string why;                                    \
    if (!have_device(&why)) GTEST_SKIP() << why;        \
  } while (0)

void check(cudaError_t err, const char* call) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(err));
}
#define CHECK_CUDA(call) check((call), #call)

// One array on the device (cudaMalloc) or in mapped pinned host memory, mirroring a host vector.
class DeviceArray {
 public:
  DeviceArray(size_t bytes, bool pinned_host) : bytes_(bytes), pinned_(pinned_host) {
    const size_t b = bytes ? bytes : 1;
    if (pinned_) CHECK_CUDA(cudaHostAlloc(&ptr_, b, cudaHostAllocMapped));
    else CHECK_CUDA(cudaMalloc(&ptr_, b));
  }
  ~DeviceArray() {
    if (pinned_) (void)cudaFreeHost(ptr_);
    else (void)cudaFree(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void* get() const { return ptr_; }
  void upload(const void* src) { CHECK_CUDA(cudaMemcpy(ptr_, src, bytes_, cudaMemcpyDefault)); }
  void download(void* dst) const { CHECK_CUDA(cudaMemcpy(dst, ptr_, bytes_, cudaMemcpyDefault)); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  bool pinned_;
};

// Puts the values the kernels must treat exactly like the CPU at fixed places.
void plant_specials(std::vector<float>& x, int salt) {
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 1e-40f, -3e-39f, 1e30f, -1e-30f};
  constexpr size_t k = sizeof(specials) / sizeof(specials[0]);
  for (size_t i = 0; i < k && (i * 37 + salt) < x.size(); ++i) x[i * 37 + salt] = specials[(i + salt) % k];
}

// Note [NaN payloads]
// Same bits, except that a NaN equals any NaN: x86 propagates an input NaN's payload and sign
// (or makes 0xFFC00000), a CUDA arithmetic instruction always returns 0x7FFFFFFF. torch's own
// CPU and CUDA optimizers differ the same way; what a NaN carries is not a value. Returns the
// first index that differs otherwise, or -1.
int64_t first_mismatch(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(a + i, b + i, 4) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}
// The same for 16-bit values: bf16 (8 exponent bits) or fp16 (5).
int64_t first_mismatch16(const uint16_t* a, const uint16_t* b, size_t n, bool bf16) {
  const uint16_t exp = bf16 ? 0x7F80 : 0x7C00, man = bf16 ? 0x007F : 0x03FF;
  auto is_nan = [&](uint16_t x) { return (x & exp) == exp && (x & man) != 0; };
  for (size_t i = 0; i < n; ++i) {
    if (is_nan(a[i]) && is_nan(b[i])) continue;
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

std::vector<uint16_t> grad_bits(const std::vector<float>& g, DType d) {
  std::vector<uint16_t> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = d == DType::kBF16 ? float_to_bf16(g[i]) : float_to_fp16(g[i]);
  return out;
}

std::vector<std::pair<std::string, AdamHyper>> adam_cases() {
  std::vector<std::pair<std::string, AdamHyper>> v;
  AdamHyper h;
  v.push_back({"adam", h});
  h = AdamHyper{};
  h.weight_decay = 0.05;
  h.lr = 1e-2;
  v.push_back({"adam_l2", h});
  h = AdamHyper{};
  h.decoupled_weight_decay = true;
  h.weight_decay = 0.1;
  h.lr = 3e-4;
  v.push_back({"adamw", h});
  h.amsgrad = true;
  v.push_back({"adamw_amsgrad", h});
  h = AdamHyper{};
  h.beta1 = 0.3;  // 1 - beta1 >= 0.5: torch's other lerp form
  h.beta2 = 0.95;
  h.maximize = true;
  h.weight_decay = 0.02;
  h.amsgrad = true;
  v.push_back({"adam_l2_maximize_amsgrad_beta1_0.3", h});
  return v;
}

std::vector<std::pair<std::string, SgdHyper>> sgd_cases() {
  std::vector<std::pair<std::string, SgdHyper>> v;
  SgdHyper h;
  h.lr = 0.1;
  v.push_back({"plain", h});
  h.momentum = 0.9;
  h.weight_decay = 1e-2;
  v.push_back({"momentum_wd", h});
  h.nesterov = true;
  h.maximize = true;
  v.push_back({"nesterov_maximize", h});
  h = SgdHyper{};
  h.lr = 0.05;
  h.momentum = 0.5;
  h.dampening = 0.3;
  v.push_back({"dampening", h});
  return v;
}

const std::vector<int64_t> kSizes = {0, 1, 255, 256, 257, 100003};

TEST(CudaAdam, SameBitsAsCpuScalarPath) {
  SUPERCHIP_SKIP_WITHOUT_GPU();
  for (bool pinned : {false, true}) {
    for (const DTypeCombo& c : all_dtype_combos()) {
      for (const auto& [name, base] : adam_cases()) {
        for (int64_t n : kSizes) {
          if (pinned && n > 1000) continue;  // mapped host memory is slow to read; small is enough
          SCOPED_TRACE(name + " grad=" + dtype_name(c.grad) + (c.has_lowp ? std::string(" lowp=") + dtype_name(c.lowp) : "") +
                       " n=" + std::to_string(n) + (pinned ? " pinned host" : " device"));
          const size_t un = static_cast<size_t>(n);
          std::mt19937 rng(static_cast<uint32_t>(n * 7 + 1));
          std::uniform_real_distribution<float> d(-2.0f, 2.0f), pos(0.0f, 1.0f);
          std::vector<float> p(un), m(un), v(un), vmax(un), g(un);
          for (size_t i = 0; i < un; ++i) {
            p[i] = d(rng);
            m[i] = 0.1f * d(rng);
            v[i] = pos(rng);
            vmax[i] = v[i] * 1.1f;
            g[i] = 1.5f * d(rng);
          }
          plant_specials(p, 1);
          plant_specials(g, 5);
          plant_specials(m, 11);
          const size_t gw = c.grad == DType::kF32 ? 4 : 2;
          DeviceArray dp(un * 4, pinned), dm(un * 4, pinned), dv(un * 4, pinned), dvmax(un * 4, pinned),
              dg(un * gw, pinned), dlp(un * 2, pinned);
          std::vector<float> cp = p, cm = m, cv = v, cvmax = vmax;
          std::vector<uint16_t> clp(un, 0), glow;
          dp.upload(p.data());
          dm.upload(m.data());
          dv.upload(v.data());
          dvmax.upload(vmax.data());
          dlp.upload(clp.data());
          for (int64_t step : {int64_t{1}, int64_t{2}, int64_t{1000}}) {
            AdamHyper h = base;
            h.step = step;
            for (float& x : g) x = 0.9f * x + 0.1f * d(rng);
            if (c.grad == DType::kF32) {
              dg.upload(g.data());
            } else {
              glow = grad_bits(g, c.grad);
              dg.upload(glow.data());
            }
            AdamArrays cpu;
            cpu.param = cp.data();
            cpu.exp_avg = cm.data();
            cpu.exp_avg_sq = cv.data();
            cpu.max_exp_avg_sq = h.amsgrad ? cvmax.data() : nullptr;
            cpu.grad = c.grad == DType::kF32 ? static_cast<const void*>(g.data()) : glow.data();
            cpu.grad_dtype = c.grad;
            cpu.param_lowp = c.has_lowp ? clp.data() : nullptr;
            cpu.lowp_dtype = c.lowp;
            cpu.n = n;
            AdamArrays gpu = cpu;
            gpu.param = static_cast<float*>(dp.get());
            gpu.exp_avg = static_cast<float*>(dm.get());
            gpu.exp_avg_sq = static_cast<float*>(dv.get());
            gpu.max_exp_avg_sq = h.amsgrad ? static_cast<float*>(dvmax.get()) : nullptr;
            gpu.grad = dg.get();
            gpu.param_lowp = c.has_lowp ? dlp.get() : nullptr;
            adam_step(h, cpu, SimdPath::kScalar);
            cuda::adam_step(h, gpu, nullptr);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            std::vector<float> rp(un), rm(un), rv(un), rvmax(un);
            std::vector<uint16_t> rlp(un);
            dp.download(rp.data());
            dm.download(rm.data());
            dv.download(rv.data());
            dvmax.download(rvmax.data());
            dlp.download(rlp.data());
            EXPECT_EQ(first_mismatch(rp.data(), cp.data(), un), -1) << "param differs, step " << step;
            EXPECT_EQ(first_mismatch(rm.data(), cm.data(), un), -1) << "exp_avg differs, step " << step;
            EXPECT_EQ(first_mismatch(rv.data(), cv.data(), un), -1) << "exp_avg_sq differs, step " << step;
            EXPECT_EQ(first_mismatch(rvmax.data(), cvmax.data(), un), -1) << "max_exp_avg_sq differs";
            EXPECT_EQ(first_mismatch16(rlp.data(), clp.data(), un, c.lowp == DType::kBF16), -1) << "param_lowp differs, step " << step;
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(CudaSgd, SameBitsAsCpuScalarPath) {
  SUPERCHIP_SKIP_WITHOUT_GPU();
  for (const DTypeCombo& c : all_dtype_combos()) {
    for (const auto& [name, base] : sgd_cases()) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(name + " grad=" + dtype_name(c.grad) + (c.has_lowp ? std::string(" lowp=") + dtype_name(c.lowp) : "") +
                     " n=" + std::to_string(n));
        const size_t un = static_cast<size_t>(n);
        std::mt19937 rng(static_cast<uint32_t>(n * 3 + 2));
        std::uniform_real_distribution<float> d(-2.0f, 2.0f);
        std::vector<float> p(un), buf(un, 0.0f), g(un);
        for (size_t i = 0; i < un; ++i) p[i] = d(rng);
        plant_specials(p, 3);
        const size_t gw = c.grad == DType::kF32 ? 4 : 2;
        DeviceArray dp(un * 4, false), dbuf(un * 4, false), dg(un * gw, false), dlp(un * 2, false);
        std::vector<float> cp = p, cbuf = buf;
        std::vector<uint16_t> clp(un, 0), glow;
        dp.upload(p.data());
        dbuf.upload(buf.data());
        dlp.upload(clp.data());
        for (int step = 0; step < 3; ++step) {
          SgdHyper h = base;
          h.first_step = step == 0;
          for (float& x : g) x = d(rng);
          plant_specials(g, 7 + step);
          if (c.grad == DType::kF32) {
            dg.upload(g.data());
          } else {
            glow = grad_bits(g, c.grad);
            dg.upload(glow.data());
          }
          SgdArrays cpu;
          cpu.param = cp.data();
          cpu.momentum_buffer = h.momentum != 0.0 ? cbuf.data() : nullptr;
          cpu.grad = c.grad == DType::kF32 ? static_cast<const void*>(g.data()) : glow.data();
          cpu.grad_dtype = c.grad;
          cpu.param_lowp = c.has_lowp ? clp.data() : nullptr;
          cpu.lowp_dtype = c.lowp;
          cpu.n = n;
          SgdArrays gpu = cpu;
          gpu.param = static_cast<float*>(dp.get());
          gpu.momentum_buffer = h.momentum != 0.0 ? static_cast<float*>(dbuf.get()) : nullptr;
          gpu.grad = dg.get();
          gpu.param_lowp = c.has_lowp ? dlp.get() : nullptr;
          sgd_step(h, cpu, SimdPath::kScalar);
          cuda::sgd_step(h, gpu, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<float> rp(un), rbuf(un);
          std::vector<uint16_t> rlp(un);
          dp.download(rp.data());
          dbuf.download(rbuf.data());
          dlp.download(rlp.data());
          EXPECT_EQ(first_mismatch(rp.data(), cp.data(), un), -1) << "param differs, step " << step;
          EXPECT_EQ(first_mismatch(rbuf.data(), cbuf.data(), un), -1) << "momentum differs, step " << step;
          EXPECT_EQ(first_mismatch16(rlp.data(), clp.data(), un, c.lowp == DType::kBF16), -1) << "param_lowp differs, step " << step;
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Argument errors are the CPU kernels' and are raised before anything is enqueued; they need
// no GPU, so this case runs everywhere the library is built.
TEST(CudaArgs, InvalidArgumentsThrowBeforeLaunch) {
  AdamHyper h;
  AdamArrays a;
  a.n = 4;  // every array missing
  EXPECT_THROW(cuda::adam_step(h, a, nullptr), std::invalid_argument);
  h.step = 0;
  a.n = 0;
  EXPECT_THROW(cuda::adam_step(h, a, nullptr), std::invalid_argument);
  SgdHyper s;
  s.momentum = 0.9;
  SgdArrays b;
  float x = 0.0f;
  b.param = &x;
  b.grad = &x;
  b.n = 1;
  EXPECT_THROW(cuda::sgd_step(s, b, nullptr), std::invalid_argument);
  // n == 0 enqueues nothing, so it needs neither arrays nor a GPU.
  SgdArrays empty;
  EXPECT_NO_THROW(cuda::sgd_step(SgdHyper{}, empty, nullptr));
}

}  // namespace
}  // namespace superchip::ops::test
