// Path selection: what the CPU supports, SUPERCHIP_SIMD forcing each path, and the errors for
// a path the CPU or the build lacks or a name that is no path.
#include <cstdlib>
#include <string>

#include "ops_test_util.h"

namespace superchip::ops::test {
namespace {

// Sets SUPERCHIP_SIMD for the scope of one test, restoring the previous value.
class ScopedSimdEnv {
 public:
  explicit ScopedSimdEnv(const char* value) {
    if (const char* old = std::getenv("SUPERCHIP_SIMD")) {
      had_ = true;
      old_ = old;
    }
    setenv("SUPERCHIP_SIMD", value, 1);
  }
  ~ScopedSimdEnv() {
    if (had_) setenv("SUPERCHIP_SIMD", old_.c_str(), 1);
    else unsetenv("SUPERCHIP_SIMD");
  }

 private:
  bool had_ = false;
  std::string old_;
};

TEST(SimdDispatch, ScalarAlwaysSupportedAndBestIsSupported) {
  EXPECT_TRUE(simd_path_supported(SimdPath::kScalar));
  EXPECT_EQ(simd_path_width(SimdPath::kScalar), 1);
  EXPECT_TRUE(simd_path_supported(best_simd_path()));
  std::string supported;
  for (SimdPath p : all_paths()) {
    if (simd_path_supported(p)) {
      supported += std::string(" ") + simd_path_name(p) + "(" + std::to_string(simd_path_width(p)) + " lanes)";
    }
    EXPECT_EQ(simd_path_width(p) > 0, simd_path_supported(p)) << simd_path_name(p);
  }
  std::printf("[ info     ] CPU: %s; supported paths:%s; best: %s\n", cpu_description().c_str(),
              supported.c_str(), simd_path_name(best_simd_path()));
}

TEST(SimdDispatch, ArchitecturePathsMatchTheBuild) {
#if defined(__x86_64__)
  EXPECT_FALSE(simd_path_supported(SimdPath::kNeon));
  EXPECT_FALSE(simd_path_supported(SimdPath::kSve));
  if (simd_path_supported(SimdPath::kAvx512)) {
    EXPECT_TRUE(simd_path_supported(SimdPath::kAvx2));
  }
#elif defined(__aarch64__)
  EXPECT_TRUE(simd_path_supported(SimdPath::kNeon));  // every AArch64 CPU has Advanced SIMD
  EXPECT_FALSE(simd_path_supported(SimdPath::kAvx2));
  EXPECT_FALSE(simd_path_supported(SimdPath::kAvx512));
  if (simd_path_supported(SimdPath::kSve)) {
    const int w = simd_path_width(SimdPath::kSve);
    EXPECT_TRUE(w >= 4 && w <= 64 && w % 4 == 0) << w;
  }
#endif
}

TEST(SimdDispatch, UnsetOrAutoGivesBest) {
  {
    ScopedSimdEnv env("");
    EXPECT_EQ(active_simd_path(), best_simd_path());
  }
  ScopedSimdEnv env("auto");
  EXPECT_EQ(active_simd_path(), best_simd_path());
}

TEST(SimdDispatch, EnvironmentForcesEverySupportedPath) {
  for (SimdPath p : all_paths()) {
    ScopedSimdEnv env(simd_path_name(p));
    if (simd_path_supported(p)) {
      EXPECT_EQ(active_simd_path(), p);
    } else {
      try {
        active_simd_path();
        ADD_FAILURE() << "forcing unsupported " << simd_path_name(p) << " did not throw";
      } catch (const std::invalid_argument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(simd_path_name(p)), std::string::npos) << msg;
        EXPECT_NE(msg.find(cpu_description()), std::string::npos) << msg;
      }
    }
  }
  ScopedSimdEnv upper("SCALAR");
  EXPECT_EQ(active_simd_path(), SimdPath::kScalar);
}

TEST(SimdDispatch, UnknownNameThrows) {
  ScopedSimdEnv env("avx9000");
  EXPECT_THROW(active_simd_path(), std::invalid_argument);
}

TEST(SimdDispatch, Names) {
  EXPECT_STREQ(simd_path_name(SimdPath::kAvx512), "avx512");
  EXPECT_STREQ(simd_path_name(SimdPath::kSve), "sve");
  EXPECT_STREQ(dtype_name(DType::kBF16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kF16), "float16");
  EXPECT_STREQ(dtype_name(DType::kF32), "float32");
}

}  // namespace
}  // namespace superchip::ops::test
