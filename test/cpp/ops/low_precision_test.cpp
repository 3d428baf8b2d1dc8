// The scalar bf16/fp16 conversions (the definition every SIMD path is held to) against the
// arithmetic references *_ref: exhaustively where the space is small, else on ties,
// neighbours and random bit patterns.
#include <limits>
#include <random>

#include "ops_test_util.h"

namespace superchip::ops::test {
namespace {

uint16_t ref_bf16(float x) { return double_to_bf16_ref(static_cast<double>(x)); }
uint16_t ref_fp16(float x) { return double_to_fp16_ref(static_cast<double>(x)); }

TEST(LowPrecision, Fp16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const float x = fp16_to_float(static_cast<uint16_t>(h));
    const bool nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0;
    if (nan) {
      ASSERT_TRUE(std::isnan(x)) << std::hex << h;
      ASSERT_EQ(float_to_fp16(x), (h & 0x8000u) | 0x7E00u) << std::hex << h;
    } else {
      ASSERT_EQ(float_to_fp16(x), h) << std::hex << h;
      ASSERT_EQ(ref_fp16(x), h) << std::hex << h;
    }
  }
}

TEST(LowPrecision, Bf16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const float x = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(x)) {
      ASSERT_EQ(float_to_bf16(x), 0x7FC0u) << std::hex << h;
    } else {
      ASSERT_EQ(float_to_bf16(x), h) << std::hex << h;
      ASSERT_EQ(ref_bf16(x), h) << std::hex << h;
    }
  }
}

TEST(LowPrecision, Fp16NarrowingMatchesReferenceAtEveryTie) {
  int64_t checked = 0;
  for (uint32_t h = 0; h < 0x7C00u; ++h) {
    const uint32_t b = float_bits(fp16_to_float(static_cast<uint16_t>(h)));
    const uint32_t next = h + 1 == 0x7C00u ? float_bits(65520.0f)  // the overflow threshold
                                           : float_bits(fp16_to_float(static_cast<uint16_t>(h + 1)));
    const uint32_t mid = b + (next - b) / 2;
    for (uint32_t u : {mid - 1, mid, mid + 1}) {
      for (float x : {bits_float(u), -bits_float(u)}) {
        ASSERT_EQ(float_to_fp16(x), ref_fp16(x)) << x;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 180000);
}

TEST(LowPrecision, NarrowingMatchesReferenceOnRandomPatterns) {
  std::mt19937 rng(1);
  for (int i = 0; i < 2000000; ++i) {
    const float x = bits_float(static_cast<uint32_t>(rng()));
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16(x), ref_bf16(x)) << std::hexfloat << x;
    ASSERT_EQ(float_to_fp16(x), ref_fp16(x)) << std::hexfloat << x;
  }
}

TEST(LowPrecision, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_bf16(inf), 0x7F80u);
  EXPECT_EQ(float_to_bf16(-inf), 0xFF80u);
  EXPECT_EQ(float_to_bf16(nan), 0x7FC0u);
  EXPECT_EQ(float_to_bf16(-nan), 0x7FC0u);           // c10::BFloat16 drops the sign
  EXPECT_EQ(float_to_bf16(bits_float(0x7F800001u)), 0x7FC0u);  // signalling NaN stays NaN
  EXPECT_EQ(float_to_bf16(bits_float(0x7F7FFFFFu)), 0x7F80u);  // FLT_MAX rounds to inf
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808000u)), 0x3F80u);  // tie, even stays
  EXPECT_EQ(float_to_bf16(bits_float(0x3F818000u)), 0x3F82u);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_float(0x00000001u)), 0x0000u);  // subnormal rounds to 0
  EXPECT_EQ(float_to_bf16(bits_float(0x00018000u)), 0x0002u);  // subnormal tie to even
  EXPECT_EQ(float_to_fp16(inf), 0x7C00u);
  EXPECT_EQ(float_to_fp16(-nan), 0xFE00u);           // c10::Half keeps the sign
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7BFFu);
  EXPECT_EQ(float_to_fp16(65519.996f), 0x7BFFu);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7C00u);
  EXPECT_EQ(float_to_fp16(0x1p-24f), 0x0001u);       // smallest subnormal
  EXPECT_EQ(float_to_fp16(0x1p-25f), 0x0000u);       // tie to even (zero)
  EXPECT_EQ(float_to_fp16(0x1.8p-24f), 0x0002u);     // tie to even (two)
  EXPECT_EQ(float_to_fp16(0x1.ffcp-15f), 0x0400u);   // tie rounds up into the smallest normal
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000u);
  EXPECT_EQ(fp16_to_float(0x0001u), 0x1p-24f);
  EXPECT_EQ(bf16_to_float(0x3F80u), 1.0f);
}

// The reference rounds a double once; going through fp32 first may round twice.
TEST(LowPrecision, ReferenceRoundsDoublesOnce) {
  const double just_above_tie = 1.0 + 0x1p-8 + 0x1p-40;  // bf16 tie + tiny: rounds up
  EXPECT_EQ(double_to_bf16_ref(just_above_tie), 0x3F81u);
  EXPECT_EQ(float_to_bf16(static_cast<float>(just_above_tie)), 0x3F80u);  // fp32 lost the tiny
}

}  // namespace
}  // namespace superchip::ops::test
