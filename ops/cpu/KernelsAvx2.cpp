// AVX2 + FMA + F16C path (8 floats per vector). Built with -mavx2 -mfma -mf16c, called only
// when the CPU has all three (SimdDispatch.cpp). See StepLoop.h for why V is file-local.
#include <immintrin.h>

#include "ops/cpu/StepLoop.h"

namespace superchip::ops::detail {
namespace {

struct VAvx2 {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg set1_bits(uint32_t b) { return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(b))); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static Reg load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Reg is_nan(Reg x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }
  static void store_bf16(uint16_t* p, Reg x) {
    x = _mm256_blendv_ps(x, set1_bits(0x7FC00000u), is_nan(x));
    __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    u = _mm256_srli_epi32(u, 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static void store_f16(uint16_t* p, Reg x) {
    // A quiet NaN with an empty payload converts to sign|0x7E00.
    const Reg canon = _mm256_or_ps(_mm256_and_ps(x, set1_bits(0x80000000u)), set1_bits(0x7FC00000u));
    x = _mm256_blendv_ps(x, canon, is_nan(x));
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm256_sqrt_ps(a); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg max_nan(Reg a, Reg b) { return _mm256_blendv_ps(_mm256_max_ps(a, b), a, is_nan(a)); }
  static Reg xor_bits(Reg a, Reg m) { return _mm256_xor_ps(a, m); }
};

}  // namespace

AdamRangeFn adam_kernel_avx2(DType grad, Lowp lowp) { return adam_table<VAvx2>(grad, lowp); }
SgdRangeFn sgd_kernel_avx2(DType grad, Lowp lowp) { return sgd_table<VAvx2>(grad, lowp); }

}  // namespace superchip::ops::detail
