// Shared helpers of the ops tests: THE tolerance table (one row per storage dtype, used by
// every comparison with the double reference), guarded buffers that can be misaligned on
// purpose, data generators, and the list of SIMD paths with the skip rule.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ops/cpu/FusedOptim.h"
#include "ops/cpu/LowPrecision.h"

namespace superchip::ops {
// Readable test names in gtest's parameter printouts.
inline void PrintTo(SimdPath p, std::ostream* os) { *os << simd_path_name(p); }
}  // namespace superchip::ops

namespace superchip::ops::test {

// ---- tolerance table ----
// |got - ref| <= atol + rtol * |ref|, ref computed in double (adam_step_ref / sgd_step_ref) from
// the same inputs, for one step. fp32: a few ulps of O(1) data (and the 1e-6 relative the
// Python tests hold us to against torch). bf16/fp16 (the low-precision parameter copy): one
// ulp, because the kernels round the fp32 result while the reference rounds the double one.
struct Tolerance {
  double atol;
  double rtol;
};

inline Tolerance tolerance(DType d) {
  switch (d) {
    case DType::kF32: return {1e-6, 1e-6};
    case DType::kBF16: return {1e-5, 0x1p-7};
    case DType::kF16: return {1e-5, 0x1p-10};
  }
  return {0.0, 0.0};
}

// ---- paths ----

inline std::vector<SimdPath> all_paths() {
  return {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512, SimdPath::kNeon, SimdPath::kSve};
}

#define SUPERCHIP_SKIP_UNSUPPORTED(path)                                                     \
  do {                                                                                     \
    if (!::superchip::ops::simd_path_supported(path)) {                                    \
      GTEST_SKIP() << "SIMD path '" << ::superchip::ops::simd_path_name(path)              \
                   << "' is not built for or not run by this CPU: "                       \
                   << ::superchip::ops::cpu_description();                                 \
    }                                                                                      \
  } while (0)

inline size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// ---- guarded, optionally misaligned buffers ----
// `n` elements of `elem` bytes starting `offset` elements past a 64-byte boundary, between
// two guard zones filled with a pattern; guards_intact() proves nothing wrote outside.
class Buffer {
 public:
  Buffer() = default;
  Buffer(int64_t n, size_t elem, int64_t offset) : n_(n), elem_(elem) {
    storage_.assign(kGuard * 2 + 64 + static_cast<size_t>(n) * elem + 64, kPattern);
    auto base = reinterpret_cast<uintptr_t>(storage_.data()) + kGuard;
    base = (base + 63) / 64 * 64 + static_cast<uintptr_t>(offset) * elem;
    begin_ = static_cast<size_t>(base - reinterpret_cast<uintptr_t>(storage_.data()));
    std::memset(data(), 0, bytes());
  }
  void* data() { return storage_.data() + begin_; }
  const void* data() const { return storage_.data() + begin_; }
  float* f32() { return static_cast<float*>(data()); }
  const float* f32() const { return static_cast<const float*>(data()); }
  uint16_t* u16() { return static_cast<uint16_t*>(data()); }
  const uint16_t* u16() const { return static_cast<const uint16_t*>(data()); }
  size_t bytes() const { return static_cast<size_t>(n_) * elem_; }
  int64_t size() const { return n_; }
  bool guards_intact() const {
    for (size_t i = 0; i < begin_; ++i) {
      if (storage_[i] != kPattern) return false;
    }
    for (size_t i = begin_ + bytes(); i < storage_.size(); ++i) {
      if (storage_[i] != kPattern) return false;
    }
    return true;
  }
  bool same_bytes(const Buffer& o) const {
    return bytes() == o.bytes() && std::memcmp(data(), o.data(), bytes()) == 0;
  }
  // Copies values (not layout) from o, which may have another offset.
  void assign(const Buffer& o) { std::memcpy(data(), o.data(), std::min(bytes(), o.bytes())); }

 private:
  static constexpr size_t kGuard = 64;
  static constexpr unsigned char kPattern = 0xA5;
  std::vector<unsigned char> storage_;
  size_t begin_ = 0;
  int64_t n_ = 0;
  size_t elem_ = 4;
};

// ---- data ----

inline void fill_uniform(Buffer& b, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < b.size(); ++i) b.f32()[i] = dist(rng);
}

// Gradient values in [lo, hi), stored in dtype d (rounded to it, as a real gradient would be).
inline void fill_grad(Buffer& b, DType d, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < b.size(); ++i) {
    const float x = dist(rng);
    if (d == DType::kF32) b.f32()[i] = x;
    else if (d == DType::kBF16) b.u16()[i] = float_to_bf16(x);
    else b.u16()[i] = float_to_fp16(x);
  }
}

inline double lowp_value(DType d, uint16_t h) {
  return d == DType::kBF16 ? bf16_to_float(h) : fp16_to_float(h);
}

// ---- comparisons ----

inline bool close(double got, double ref, Tolerance t) {
  if (std::isnan(got) || std::isnan(ref)) return std::isnan(got) && std::isnan(ref);
  if (std::isinf(ref)) return got == ref;
  return std::fabs(got - ref) <= t.atol + t.rtol * std::fabs(ref);
}

// Checks every element; reports the count and the first few offenders.
inline ::testing::AssertionResult all_close(const char* what, const float* got, const float* ref,
                                            int64_t n) {
  const Tolerance t = tolerance(DType::kF32);
  int64_t bad = 0;
  std::string first;
  for (int64_t i = 0; i < n; ++i) {
    if (close(got[i], ref[i], t)) continue;
    if (bad++ < 4) {
      first += " [" + std::to_string(i) + "] got " + std::to_string(got[i]) + " ref " +
               std::to_string(ref[i]) + ";";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << n
                                       << " elements outside fp32 tolerance:" << first;
}

inline ::testing::AssertionResult all_close_lowp(const char* what, DType d, const uint16_t* got,
                                                 const uint16_t* ref, int64_t n) {
  const Tolerance t = tolerance(d);
  int64_t bad = 0;
  std::string first;
  for (int64_t i = 0; i < n; ++i) {
    if (close(lowp_value(d, got[i]), lowp_value(d, ref[i]), t)) continue;
    if (bad++ < 4) {
      first += " [" + std::to_string(i) + "] got " + std::to_string(lowp_value(d, got[i])) +
               " ref " + std::to_string(lowp_value(d, ref[i])) + ";";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << n << " elements outside "
                                       << dtype_name(d) << " tolerance:" << first;
}

// The low-precision copy must be exactly the rounded fp32 result.
inline ::testing::AssertionResult lowp_matches_param(DType d, const uint16_t* lowp,
                                                     const float* param, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t want = d == DType::kBF16 ? float_to_bf16(param[i]) : float_to_fp16(param[i]);
    if (lowp[i] != want) {
      return ::testing::AssertionFailure()
             << "param_lowp[" << i << "] = 0x" << std::hex << lowp[i] << ", expected 0x" << want
             << " (" << dtype_name(d) << " of fp32 " << param[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Sizes that hit every tail of a path of width w, the 64-byte head peel and a large body.
inline std::vector<int64_t> tail_sizes(int w) {
  std::vector<int64_t> s = {0, 1, w - 1, w, w + 1, 2 * w + 3, 53, 100003};
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  s.erase(std::remove_if(s.begin(), s.end(), [](int64_t x) { return x < 0; }), s.end());
  return s;
}

struct DTypeCombo {
  DType grad;
  bool has_lowp;
  DType lowp;
};

inline std::vector<DTypeCombo> all_dtype_combos() {
  std::vector<DTypeCombo> out;
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
    out.push_back({g, false, DType::kBF16});
    out.push_back({g, true, DType::kBF16});
    out.push_back({g, true, DType::kF16});
  }
  return out;
}

inline void PrintTo(const DTypeCombo& c, std::ostream* os) {
  *os << "grad " << dtype_name(c.grad) << ", lowp " << (c.has_lowp ? dtype_name(c.lowp) : "none");
}

inline std::string combo_name(SimdPath p, const DTypeCombo& c) {
  std::string s = std::string(simd_path_name(p)) + "_grad_" + dtype_name(c.grad);
  s += c.has_lowp ? std::string("_lowp_") + dtype_name(c.lowp) : std::string("_no_lowp");
  return s;
}

}  // namespace superchip::ops::test
