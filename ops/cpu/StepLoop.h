// Internal to ops/cpu: the Adam and SGD step written once over a vector policy V, instantiated
// by each fixed-width path (KernelsScalar/Avx2/Avx512/Neon.cpp; SVE is vector-length agnostic
// and spells the same formulas out in KernelsSve.cpp).
//
// V provides: Reg, kWidth, set1, set1_bits, load/store (fp32), load_bf16/load_f16,
// store_bf16/store_f16 (nearest-even, canonical NaN, see LowPrecision.h), add, sub, mul, div,
// sqrt (all IEEE, correctly rounded), fma(a, b, c) = a*b + c rounded once, max_nan (NaN of
// either operand wins, else the larger, ties give b), xor_bits. Loads and stores take any
// alignment.
//
// Every instantiation must use a V declared in an anonymous namespace: that gives the
// instantiations internal linkage, so code compiled with -mavx512f can never be picked by the
// linker for a caller on a CPU without it. For the same reason this header includes nothing
// but <cstdint> and <cstring>, and defines no non-template inline function.
//
// adam_block and sgd_block are also the per-element body of the CUDA kernels (ops/cuda), with
// a V of CUDA's correctly rounded intrinsics and kWidth 1: nvcc compiles them for the device
// through SUPERCHIP_HD, which is empty for every other compiler. One body, so the GPU gives
// the CPU's bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/cpu/StepKernels.h"

#if defined(__CUDACC__)
#define SUPERCHIP_HD __host__ __device__
#else
#define SUPERCHIP_HD
#endif

namespace superchip::ops::detail {

template <DType kG>
struct GradStorage { using T = float; };
template <>
struct GradStorage<DType::kBF16> { using T = uint16_t; };
template <>
struct GradStorage<DType::kF16> { using T = uint16_t; };

template <class V, DType kG>
SUPERCHIP_HD inline typename V::Reg load_grad(const void* g, int64_t i) {
  if constexpr (kG == DType::kF32) {
    return V::load(static_cast<const float*>(g) + i);
  } else if constexpr (kG == DType::kBF16) {
    return V::load_bf16(static_cast<const uint16_t*>(g) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(g) + i);
  }
}

template <class V, Lowp kL>
SUPERCHIP_HD inline void store_lowp(void* d, int64_t i, typename V::Reg x) {
  if constexpr (kL == Lowp::kBF16) {
    V::store_bf16(static_cast<uint16_t*>(d) + i, x);
  } else if constexpr (kL == Lowp::kF16) {
    V::store_f16(static_cast<uint16_t*>(d) + i, x);
  }
}

// Elements before the first (kWidth * 4)-byte boundary of `p` (0 if p is not 4-aligned).
template <class V>
inline int64_t elements_to_boundary(const float* p) {
  constexpr uintptr_t kBytes = V::kWidth * sizeof(float);
  const auto addr = reinterpret_cast<uintptr_t>(p);
  if (addr % sizeof(float) != 0) return 0;
  return static_cast<int64_t>(((kBytes - addr % kBytes) % kBytes) / sizeof(float));
}

// Runs `block(ptrs, i)` over [b, e): full vectors on the body, and the unaligned head and the
// tail through zero-padded stack copies, so every element goes through the same vector code
// whatever the split (results never depend on alignment or threads).
template <class V, class Ptrs, class Block, class Pad>
inline void run_range(const Ptrs& q, const float* param, int64_t b, int64_t e, Block block,
                      Pad pad) {
  constexpr int64_t W = V::kWidth;
  int64_t i = b;
  int64_t head = elements_to_boundary<V>(param + b);
  if (head > e - b) head = e - b;
  if (head > 0) {
    pad(i, head);
    i += head;
  }
  for (; i + W <= e; i += W) block(q, i);
  if (i < e) pad(i, e - i);
}

// ---- Adam / AdamW ----

struct AdamPtrs {
  float* p;
  float* m;
  float* v;
  float* vmax;
  const void* g;
  void* lp;
};

template <class V, DType kG, Lowp kL>
SUPERCHIP_HD inline void adam_block(const AdamScalars& s, const AdamPtrs& q, int64_t i) {
  using R = typename V::Reg;
  R g = V::xor_bits(load_grad<V, kG>(q.g, i), V::set1_bits(s.sign_mask));
  R p = V::load(q.p + i);
  if (s.decoupled) {
    p = V::mul(p, V::set1(s.decay_mul));
  } else if (s.l2) {
    g = V::fma(p, V::set1(s.wd), g);
  }
  R m = V::load(q.m + i);
  m = V::fma(V::set1(s.lerp_coef), V::sub(g, m), s.lerp_small ? m : g);
  R v = V::mul(V::load(q.v + i), V::set1(s.beta2));
  v = V::fma(V::mul(V::set1(s.one_minus_beta2), g), g, v);
  R vhat = v;
  if (s.amsgrad) {
    vhat = V::max_nan(V::load(q.vmax + i), v);
    V::store(q.vmax + i, vhat);
  }
  const R denom = V::add(V::div(V::sqrt(vhat), V::set1(s.bc2_sqrt)), V::set1(s.eps));
  p = V::add(p, V::div(V::mul(V::set1(s.neg_step_size), m), denom));
  V::store(q.p + i, p);
  V::store(q.m + i, m);
  V::store(q.v + i, v);
  store_lowp<V, kL>(q.lp, i, p);
}

template <class V, DType kG, Lowp kL>
inline void adam_padded(const AdamScalars& s, const AdamPtrs& q, int64_t i, int64_t k) {
  using GT = typename GradStorage<kG>::T;
  constexpr int64_t W = V::kWidth;
  alignas(64) float p[W] = {}, m[W] = {}, v[W] = {}, vmax[W] = {};
  alignas(64) GT g[W] = {};
  alignas(64) uint16_t lp[W] = {};
  const size_t fb = static_cast<size_t>(k) * sizeof(float);
  std::memcpy(p, q.p + i, fb);
  std::memcpy(m, q.m + i, fb);
  std::memcpy(v, q.v + i, fb);
  if (s.amsgrad) std::memcpy(vmax, q.vmax + i, fb);
  std::memcpy(g, static_cast<const GT*>(q.g) + i, static_cast<size_t>(k) * sizeof(GT));
  const AdamPtrs t{p, m, v, vmax, g, lp};
  adam_block<V, kG, kL>(s, t, 0);
  std::memcpy(q.p + i, p, fb);
  std::memcpy(q.m + i, m, fb);
  std::memcpy(q.v + i, v, fb);
  if (s.amsgrad) std::memcpy(q.vmax + i, vmax, fb);
  if constexpr (kL != Lowp::kNone) {
    std::memcpy(static_cast<uint16_t*>(q.lp) + i, lp, static_cast<size_t>(k) * sizeof(uint16_t));
  }
}

template <class V, DType kG, Lowp kL>
void adam_range(const AdamScalars& s_in, const AdamArrays& a, int64_t b, int64_t e) {
  const AdamScalars s = s_in;  // a local copy: stores through float* cannot alias it
  const AdamPtrs q{a.param, a.exp_avg, a.exp_avg_sq, a.max_exp_avg_sq, a.grad, a.param_lowp};
  run_range<V>(
      q, a.param, b, e, [&s](const AdamPtrs& x, int64_t i) { adam_block<V, kG, kL>(s, x, i); },
      [&s, &q](int64_t i, int64_t k) { adam_padded<V, kG, kL>(s, q, i, k); });
}

// ---- SGD ----

struct SgdPtrs {
  float* p;
  float* buf;
  const void* g;
  void* lp;
};

template <class V, DType kG, Lowp kL>
SUPERCHIP_HD inline void sgd_block(const SgdScalars& s, const SgdPtrs& q, int64_t i) {
  using R = typename V::Reg;
  R g = V::xor_bits(load_grad<V, kG>(q.g, i), V::set1_bits(s.sign_mask));
  R p = V::load(q.p + i);
  if (s.l2) g = V::fma(p, V::set1(s.wd), g);
  if (s.has_momentum) {
    R buf = g;
    if (!s.first_step) {
      buf = V::fma(g, V::set1(s.one_minus_dampening),
                   V::mul(V::load(q.buf + i), V::set1(s.momentum)));
    }
    V::store(q.buf + i, buf);
    g = s.nesterov ? V::fma(buf, V::set1(s.momentum), g) : buf;
  }
  p = V::fma(g, V::set1(s.neg_lr), p);
  V::store(q.p + i, p);
  store_lowp<V, kL>(q.lp, i, p);
}

template <class V, DType kG, Lowp kL>
inline void sgd_padded(const SgdScalars& s, const SgdPtrs& q, int64_t i, int64_t k) {
  using GT = typename GradStorage<kG>::T;
  constexpr int64_t W = V::kWidth;
  alignas(64) float p[W] = {}, buf[W] = {};
  alignas(64) GT g[W] = {};
  alignas(64) uint16_t lp[W] = {};
  const size_t fb = static_cast<size_t>(k) * sizeof(float);
  std::memcpy(p, q.p + i, fb);
  if (s.has_momentum && !s.first_step) std::memcpy(buf, q.buf + i, fb);
  std::memcpy(g, static_cast<const GT*>(q.g) + i, static_cast<size_t>(k) * sizeof(GT));
  const SgdPtrs t{p, buf, g, lp};
  sgd_block<V, kG, kL>(s, t, 0);
  std::memcpy(q.p + i, p, fb);
  if (s.has_momentum) std::memcpy(q.buf + i, buf, fb);
  if constexpr (kL != Lowp::kNone) {
    std::memcpy(static_cast<uint16_t*>(q.lp) + i, lp, static_cast<size_t>(k) * sizeof(uint16_t));
  }
}

template <class V, DType kG, Lowp kL>
void sgd_range(const SgdScalars& s_in, const SgdArrays& a, int64_t b, int64_t e) {
  const SgdScalars s = s_in;
  const SgdPtrs q{a.param, a.momentum_buffer, a.grad, a.param_lowp};
  run_range<V>(
      q, a.param, b, e, [&s](const SgdPtrs& x, int64_t i) { sgd_block<V, kG, kL>(s, x, i); },
      [&s, &q](int64_t i, int64_t k) { sgd_padded<V, kG, kL>(s, q, i, k); });
}

// ---- tables ----

template <class V, DType kG>
AdamRangeFn adam_table_for_grad(Lowp lowp) {
  switch (lowp) {
    case Lowp::kBF16: return &adam_range<V, kG, Lowp::kBF16>;
    case Lowp::kF16: return &adam_range<V, kG, Lowp::kF16>;
    default: return &adam_range<V, kG, Lowp::kNone>;
  }
}

template <class V>
AdamRangeFn adam_table(DType grad, Lowp lowp) {
  switch (grad) {
    case DType::kBF16: return adam_table_for_grad<V, DType::kBF16>(lowp);
    case DType::kF16: return adam_table_for_grad<V, DType::kF16>(lowp);
    default: return adam_table_for_grad<V, DType::kF32>(lowp);
  }
}

template <class V, DType kG>
SgdRangeFn sgd_table_for_grad(Lowp lowp) {
  switch (lowp) {
    case Lowp::kBF16: return &sgd_range<V, kG, Lowp::kBF16>;
    case Lowp::kF16: return &sgd_range<V, kG, Lowp::kF16>;
    default: return &sgd_range<V, kG, Lowp::kNone>;
  }
}

template <class V>
SgdRangeFn sgd_table(DType grad, Lowp lowp) {
  switch (grad) {
    case DType::kBF16: return sgd_table_for_grad<V, DType::kBF16>(lowp);
    case DType::kF16: return sgd_table_for_grad<V, DType::kF16>(lowp);
    default: return sgd_table_for_grad<V, DType::kF32>(lowp);
  }
}

}  // namespace superchip::ops::detail
