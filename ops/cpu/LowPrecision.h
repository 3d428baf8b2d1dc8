// Scalar bf16/fp16 <-> fp32 conversions used by the scalar path, the reference and the tests.
// Widening is exact. Narrowing rounds to nearest-even (IEEE: subnormals kept, overflow to inf)
// and turns NaN into one canonical quiet NaN: bf16 0x7FC0 (as c10::BFloat16), fp16
// sign|0x7E00 (as c10::Half). Every SIMD path produces the same bits as these functions.
// The *_ref functions round a double by plain arithmetic (no bit tricks), to check the others.
// Internal to ops/: not part of the FusedOptim.h contract. Never include it from a file built
// with ISA flags (-mavx2, ...): its inline functions would be emitted with those instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace superchip::ops {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t{h} << 16); }

inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = float_bits(f);
  // Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly when the
  // dropped half is above one half, or equal to it with an odd kept part (ties to even).
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    // Subnormal (or zero): man * 2^-24 is exact in fp32.
    return bits_float(sign | float_bits(static_cast<float>(man) * 0x1p-24f));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf (and inf itself)
  if (a < 0x38800000u) {                         // below 2^-14: fp16 subnormal or zero
    const uint32_t e = a >> 23;
    if (e < 102) return sign;  // below 2^-25: rounds to zero
    // value = m * 2^(e-150); in units of the subnormal quantum 2^-24 that is m >> (126 - e).
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;  // may carry into the smallest normal
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

namespace detail {
// Rounds |x| (finite, > 0) to `mant_bits` fraction bits with minimum normal exponent
// `min_exp`, ties to even; returns the rounded value (exact in double).
inline double round_mantissa_ref(double ax, int mant_bits, int min_exp) {
  const int e = std::ilogb(ax);
  const int q = (e > min_exp ? e : min_exp) - mant_bits;  // exponent of the last kept bit
  return std::ldexp(std::nearbyint(std::ldexp(ax, -q)), q);
}
// Encodes a value `v` >= 0 that is exactly representable in the target format.
inline uint16_t encode_ref(double v, int mant_bits, int min_exp, int bias) {
  if (v == 0.0) return 0;
  if (v < std::ldexp(1.0, min_exp)) {  // subnormal: the count of quanta
    return static_cast<uint16_t>(std::ldexp(v, mant_bits - min_exp));
  }
  const int e = std::ilogb(v);
  const double frac = std::ldexp(v, -e) - 1.0;  // in [0, 1)
  return static_cast<uint16_t>(((e + bias) << mant_bits) |
                               static_cast<int>(std::ldexp(frac, mant_bits)));
}
}  // namespace detail

// Reference narrowing of a double (rounded once, so no double rounding through fp32).
inline uint16_t double_to_bf16_ref(double x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double ax = std::fabs(x);
  if (ax == 0.0) return sign;
  const double max_bf16 = std::ldexp(255.0, 120);  // (2 - 2^-7) * 2^127
  if (std::isinf(ax)) return sign | 0x7F80;
  const double r = detail::round_mantissa_ref(ax, 7, -126);
  if (r > max_bf16) return sign | 0x7F80;
  return sign | detail::encode_ref(r, 7, -126, 127);
}

inline uint16_t double_to_fp16_ref(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7E00;
  const double ax = std::fabs(x);
  if (ax == 0.0) return sign;
  if (std::isinf(ax)) return sign | 0x7C00;
  const double r = detail::round_mantissa_ref(ax, 10, -14);
  if (r > 65504.0) return sign | 0x7C00;
  return sign | detail::encode_ref(r, 10, -14, 15);
}

}  // namespace superchip::ops
