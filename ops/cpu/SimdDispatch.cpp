// Which SIMD paths this build has (SUPERCHIP_OPS_HAVE_*, set by ops/cpu/CMakeLists.txt) and
// which this CPU and OS can run (CPUID + XGETBV on x86-64, HWCAP on AArch64), probed once.
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

#include "ops/cpu/FusedOptim.h"
#include "ops/cpu/StepKernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace superchip::ops {
namespace {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool os_ymm = false;  // the OS saves the YMM state
  bool os_zmm = false;  // ... and the opmask/ZMM state
  bool asimd = false;
  bool sve = false;
  std::string model;
};

std::string proc_cpuinfo_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, implementer, part;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && std::isspace(static_cast<unsigned char>(key.back()))) key.pop_back();
    std::string value = line.substr(colon + 1);
    while (!value.empty() && std::isspace(static_cast<unsigned char>(value.front()))) value.erase(0, 1);
    if (key == "model name") return value;
    if (key == "CPU implementer" && implementer.empty()) implementer = value;
    if (key == "CPU part" && part.empty()) part = value;
  }
  if (!implementer.empty()) return "implementer " + implementer + " part " + part;
  return "unknown CPU";
}

CpuFeatures probe() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    f.fma = (c >> 12) & 1;
    f.f16c = (c >> 29) & 1;
    const bool osxsave = (c >> 27) & 1;
    if (osxsave) {
      unsigned lo = 0, hi = 0;
      __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      f.os_ymm = (lo & 0x6u) == 0x6u;     // SSE + AVX state
      f.os_zmm = (lo & 0xE6u) == 0xE6u;   // + opmask, ZMM_Hi256, Hi16_ZMM
    }
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = (b >> 5) & 1;
    f.avx512f = (b >> 16) & 1;
  }
  unsigned brand[12] = {};
  if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000004u) {
    for (unsigned k = 0; k < 3; ++k) {
      __get_cpuid(0x80000002u + k, &brand[4 * k], &brand[4 * k + 1], &brand[4 * k + 2],
                  &brand[4 * k + 3]);
    }
    char text[49] = {};
    std::memcpy(text, brand, 48);
    f.model = text;
    while (!f.model.empty() && f.model.back() == ' ') f.model.pop_back();
    while (!f.model.empty() && f.model.front() == ' ') f.model.erase(0, 1);
  }
#endif
#if defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP);
  f.asimd = (hw >> 1) & 1;   // HWCAP_ASIMD
  f.sve = (hw >> 22) & 1;    // HWCAP_SVE
#elif defined(__aarch64__)
  f.asimd = true;
#endif
  if (f.model.empty()) f.model = proc_cpuinfo_model();
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = probe();
  return f;
}

constexpr SimdPath kAllPaths[] = {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512,
                                  SimdPath::kNeon, SimdPath::kSve};

bool path_built(SimdPath p) {
  switch (p) {
    case SimdPath::kScalar: return true;
#if defined(SUPERCHIP_OPS_HAVE_AVX2)
    case SimdPath::kAvx2: return true;
#endif
#if defined(SUPERCHIP_OPS_HAVE_AVX512)
    case SimdPath::kAvx512: return true;
#endif
#if defined(SUPERCHIP_OPS_HAVE_NEON)
    case SimdPath::kNeon: return true;
#endif
#if defined(SUPERCHIP_OPS_HAVE_SVE)
    case SimdPath::kSve: return true;
#endif
    default: return false;
  }
}

bool cpu_runs(SimdPath p) {
  const CpuFeatures& f = features();
  switch (p) {
    case SimdPath::kScalar: return true;
    case SimdPath::kAvx2: return f.avx2 && f.fma && f.f16c && f.os_ymm;
    case SimdPath::kAvx512: return f.avx512f && f.avx2 && f.fma && f.f16c && f.os_zmm;
    case SimdPath::kNeon: return f.asimd;
    case SimdPath::kSve: return f.sve;
  }
  return false;
}

std::string path_list(bool (*pred)(SimdPath)) {
  std::string out;
  for (SimdPath p : kAllPaths) {
    if (!pred(p)) continue;
    if (!out.empty()) out += ", ";
    out += simd_path_name(p);
  }
  return out;
}

}  // namespace

const char* simd_path_name(SimdPath p) noexcept {
  switch (p) {
    case SimdPath::kScalar: return "scalar";
    case SimdPath::kAvx2: return "avx2";
    case SimdPath::kAvx512: return "avx512";
    case SimdPath::kNeon: return "neon";
    case SimdPath::kSve: return "sve";
  }
  return "unknown";
}

bool simd_path_supported(SimdPath p) noexcept { return path_built(p) && cpu_runs(p); }

SimdPath best_simd_path() noexcept {
  for (SimdPath p : {SimdPath::kAvx512, SimdPath::kAvx2, SimdPath::kSve, SimdPath::kNeon}) {
    if (simd_path_supported(p)) return p;
  }
  return SimdPath::kScalar;
}

int simd_path_width(SimdPath p) noexcept {
  if (!simd_path_supported(p)) return 0;
  switch (p) {
    case SimdPath::kScalar: return 1;
    case SimdPath::kAvx2: return 8;
    case SimdPath::kAvx512: return 16;
    case SimdPath::kNeon: return 4;
    case SimdPath::kSve:
#if defined(SUPERCHIP_OPS_HAVE_SVE)
      return detail::sve_lanes();
#else
      return 0;
#endif
  }
  return 0;
}

std::string cpu_description() {
  const CpuFeatures& f = features();
  std::string isa;
  auto add = [&isa](bool has, const char* name) {
    if (!has) return;
    isa += isa.empty() ? "" : " ";
    isa += name;
  };
#if defined(__x86_64__)
  const char* arch = "x86-64";
#elif defined(__aarch64__)
  const char* arch = "aarch64";
#else
  const char* arch = "other";
#endif
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.asimd, "asimd");
  add(f.sve, "sve");
  return f.model + " (" + arch + ": " + (isa.empty() ? "no SIMD features used here" : isa) + ")";
}

SimdPath active_simd_path() {
  const char* env = std::getenv("SUPERCHIP_SIMD");
  if (env == nullptr || *env == '\0') return best_simd_path();
  std::string want(env);
  for (char& ch : want) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (want == "auto") return best_simd_path();
  for (SimdPath p : kAllPaths) {
    if (want != simd_path_name(p)) continue;
    if (simd_path_supported(p)) return p;
    throw std::invalid_argument(
        std::string("SUPERCHIP_SIMD=") + env + " forces the " + simd_path_name(p) +
        " path, which " + (path_built(p) ? "this CPU cannot run" : "this build does not have") +
        "; CPU: " + cpu_description() + "; paths built: " + path_list(&path_built) +
        "; paths this CPU runs: " + path_list(&simd_path_supported));
  }
  throw std::invalid_argument(std::string("SUPERCHIP_SIMD=") + env +
                              " is not one of auto, scalar, avx2, avx512, neon, sve");
}

}  // namespace superchip::ops
