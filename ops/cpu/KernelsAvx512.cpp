// AVX-512F path (16 floats per vector). Built with -mavx512f (plus AVX2/FMA/F16C), called only
// when the CPU and OS support AVX-512F (SimdDispatch.cpp). Uses AVX-512F instructions only
// (no DQ/BW/BF16): vcvtneps2bf16 would flush subnormals, so bf16 rounding is done on integers.
#include <immintrin.h>

#include "ops/cpu/StepLoop.h"

namespace superchip::ops::detail {
namespace {

struct VAvx512 {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static __m512i ibits(uint32_t b) { return _mm512_set1_epi32(static_cast<int>(b)); }
  static Reg set1_bits(uint32_t b) { return _mm512_castsi512_ps(ibits(b)); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static Reg load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __mmask16 is_nan(Reg x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
  static void store_bf16(uint16_t* p, Reg x) {
    __m512i u = _mm512_mask_blend_epi32(is_nan(x), _mm512_castps_si512(x), ibits(0x7FC00000u));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), ibits(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, ibits(0x7FFF)));
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void store_f16(uint16_t* p, Reg x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i canon = _mm512_or_si512(_mm512_and_si512(u, ibits(0x80000000u)), ibits(0x7FC00000u));
    x = _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_nan(x), u, canon));
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm512_sqrt_ps(a); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg max_nan(Reg a, Reg b) { return _mm512_mask_blend_ps(is_nan(a), _mm512_max_ps(a, b), a); }
  static Reg xor_bits(Reg a, Reg m) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(m)));
  }
};

}  // namespace

AdamRangeFn adam_kernel_avx512(DType grad, Lowp lowp) { return adam_table<VAvx512>(grad, lowp); }
SgdRangeFn sgd_kernel_avx512(DType grad, Lowp lowp) { return sgd_table<VAvx512>(grad, lowp); }

}  // namespace superchip::ops::detail
