#include "backend/runtime/Runtime.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "allocator/Topology.h"

namespace superchip {
namespace {

constexpr int kMaxDevices = 64;

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : std::string(fallback);
}

bool cuda_usable() noexcept {
#ifdef SUPERCHIP_HAVE_CUDA
  try {
    // torch's CUDA hooks, not the CUDA device guard: on a machine without a GPU, torch's
    // FakeTensorMode (torch.compile, torch.export) installs a no-op CUDA guard that claims 8
    // devices (torch._C._ensureCUDADeviceGuardSet), so a process that compiled anything before
    // `import superchip` chose the CUDA executor and failed at import ("Found no NVIDIA
    // driver"; found by running the suite with a CUDA build of torch on a machine without one).
    if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return false;
    return at::detail::getCUDAHooks().hasCUDA();
  } catch (...) {
    return false;
  }
#else
  return false;
#endif
}

Executor choose_executor() {
  std::string want = env_or("SUPERCHIP_EXECUTOR", "");
  for (char& c : want) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));  // CPU, Cuda
  if (want.empty()) return cuda_usable() ? Executor::kCuda : Executor::kCpu;
  if (want == "cpu") return Executor::kCpu;
  TORCH_CHECK(want == "cuda", "SUPERCHIP_EXECUTOR must be 'cpu' or 'cuda', got '", want,
              "'. Unset it to let superchip choose.");
#ifndef SUPERCHIP_HAVE_CUDA
  TORCH_CHECK(false, "SUPERCHIP_EXECUTOR=cuda, but this superchip build has no CUDA support "
              "(no CUDA toolkit at build time). Rebuild with the toolkit or use SUPERCHIP_EXECUTOR=cpu.");
#endif
  TORCH_CHECK(cuda_usable(), "SUPERCHIP_EXECUTOR=cuda, but torch reports no usable CUDA GPU "
              "(torch ", "built without CUDA or no device visible). Use SUPERCHIP_EXECUTOR=cpu.");
  return Executor::kCuda;
}

thread_local c10::DeviceIndex tls_current_device = 0;

std::mutex managers_mutex;
std::array<std::atomic<MemoryManager*>, kMaxDevices> managers{};

size_t default_hbm_budget() {
  // Emulated HBM: a quarter of physical memory, at most 16 GiB, so the host tier keeps room.
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  const size_t phys = (pages > 0 && page > 0) ? size_t(pages) * size_t(page) : (size_t(8) << 30);
  return std::min(phys / 4, size_t(16) << 30);
}

// The GPU's memory less a margin for what lives there outside superchip's view: the CUDA
// context, library workspaces (cuBLAS, cuDNN) and the slack of CUDA's caching allocator, which
// holds forwarded kernels' outputs (counted in hbm only while allocated). A known budget is
// what lets placement keep an activation reserve and the streaming plan size its arena.
// 0 (unlimited) when the runtime cannot tell.
size_t gpu_hbm_budget(c10::DeviceIndex index) {
  const size_t total = cuda_memory_info(index).second;
  const size_t margin = std::max(size_t{1} << 30, total / 16);
  return total > 2 * margin ? total - margin : 0;
}

}  // namespace

Executor executor() {
  static const Executor e = choose_executor();
  return e;
}

const char* executor_name(Executor e) noexcept { return e == Executor::kCuda ? "cuda" : "cpu"; }

c10::DeviceType executor_device_type() {
  return executor() == Executor::kCuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
}

c10::DispatchKey executor_dispatch_key() {
  return executor() == Executor::kCuda ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
}

c10::Device executor_device(c10::DeviceIndex index) {
  if (executor() == Executor::kCuda) return c10::Device(c10::DeviceType::CUDA, index);
  return c10::Device(c10::DeviceType::CPU);
}

namespace {
// SUPERCHIP_DEVICE_COUNT: a whole number from 1 to kMaxDevices, else 0 (malformed). It was
// read with strtol and clamped, so "abc", "0" and "-1" gave one device and "2abc" two, with
// no word: a torchrun job then had fewer devices than local ranks (found by review).
long emulated_device_count(const std::string& text) {
  const long v = parse_whole_number(text);
  return v >= 1 && v <= kMaxDevices ? v : 0;
}
}  // namespace

c10::DeviceIndex device_count() noexcept {
  static const c10::DeviceIndex count = []() -> c10::DeviceIndex {
    try {
      if (executor() == Executor::kCuda) {
        return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount();
      }
      const long v = emulated_device_count(env_or("SUPERCHIP_DEVICE_COUNT", "1"));
      return static_cast<c10::DeviceIndex>(v > 0 ? v : 1);  // check_environment() raises
    } catch (...) {
      return 0;
    }
  }();
  return count;
}

void check_environment() {
  if (executor() == Executor::kCuda) return;  // the GPUs are the devices
  const std::string n = env_or("SUPERCHIP_DEVICE_COUNT", "1");
  TORCH_CHECK(emulated_device_count(n) > 0, "SUPERCHIP_DEVICE_COUNT must be a whole number of "
              "emulated superchip devices from 1 to ", kMaxDevices, "; got '", n, "'. Unset it for one "
              "device (with the CUDA executor the GPUs are the devices and it is not used).");
}

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "superchip device index ", int(index),
              " is out of range: this process has ", int(device_count()),
              " superchip device(s) (indices 0..", int(device_count()) - 1, ").");
}

c10::DeviceIndex current_device() {
  if (executor() == Executor::kCuda) {
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  }
  return tls_current_device;
}

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  if (executor() == Executor::kCuda) {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
        ->setDevice(c10::Device(c10::DeviceType::CUDA, index));
    return;
  }
  tls_current_device = index;
}

c10::DeviceIndex resolve_device(c10::DeviceIndex index) {
  if (index < 0) return current_device();
  check_device_index(index);
  return index;
}

long parse_whole_number(const std::string& text) {
  size_t first = 0, last = text.size();  // spaces around it, a CR from a CRLF env file
  while (first < last && std::isspace(static_cast<unsigned char>(text[first]))) ++first;
  while (last > first && std::isspace(static_cast<unsigned char>(text[last - 1]))) --last;
  const std::string digits = text.substr(first, last - first);
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(digits.c_str(), &end, 10);
  if (digits.empty() || end == digits.c_str() || *end != '\0' || errno != 0) return -1;
  return v;
}

size_t parse_bytes(const std::string& text, const char* what, bool zero_is_unlimited) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  double scale = 1;
  std::string suffix(end ? end : "");
  while (!suffix.empty() && std::isspace(static_cast<unsigned char>(suffix.back()))) suffix.pop_back();
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.pop_back();
  if (suffix.size() == 2 && (suffix[1] == 'i' || suffix[1] == 'I')) suffix.pop_back();
  if (suffix.size() == 1) {
    switch (std::toupper(static_cast<unsigned char>(suffix[0]))) {
      case 'K': scale = 1024.0; break;
      case 'M': scale = 1024.0 * 1024; break;
      case 'G': scale = 1024.0 * 1024 * 1024; break;
      case 'T': scale = 1024.0 * 1024 * 1024 * 1024; break;
      default: scale = -1;
    }
  } else if (!suffix.empty()) {
    scale = -1;
  }
  TORCH_CHECK(end != text.c_str() && scale > 0 && v >= 0 && std::isfinite(v), what,
              " must be a byte count such as 1073741824, 512M or 8G; got '", text, "'.");
  // 0 is "no budget"; a fraction of a byte would read as that too.
  TORCH_CHECK(v == 0 || v * scale >= 1, what, "='", text, "' is less than one byte; give a "
              "byte count such as 512M or 8G", zero_is_unlimited ? " (0 means no budget)." : ".");
  // Past 2^63 the conversion to size_t is undefined (x86 gives 0, which reads as "no budget").
  TORCH_CHECK(v * scale < 9223372036854775808.0, what, "='", text,
              "' is more than 2^63 bytes; give the budget the machine has, such as 512M or 8G.");
  return static_cast<size_t>(v * scale);
}

MemoryManager* memory_if_created(c10::DeviceIndex index) noexcept {
  if (index < 0 || index >= kMaxDevices) return nullptr;
  return managers[index].load(std::memory_order_acquire);
}

MemoryManager& memory(c10::DeviceIndex index) {
  if (MemoryManager* m = memory_if_created(index)) return *m;
  check_device_index(index);
  std::lock_guard<std::mutex> lock(managers_mutex);
  if (MemoryManager* m = managers[index].load(std::memory_order_acquire)) return *m;
  MemoryConfig cfg;
  cfg.device_index = index;
  cfg.cuda = executor() == Executor::kCuda;
  const std::string hbm = env_or("SUPERCHIP_HBM_BYTES", "");
  cfg.hbm_capacity = hbm.empty() ? (cfg.cuda ? gpu_hbm_budget(index) : default_hbm_budget())
                                 : parse_bytes(hbm, "SUPERCHIP_HBM_BYTES");
  const std::string reserve = env_or("SUPERCHIP_HBM_RESERVE", "");
  if (!reserve.empty() && reserve.back() == '%') {
    char* end = nullptr;
    const double pct = std::strtod(reserve.c_str(), &end);
    TORCH_CHECK(end == reserve.c_str() + reserve.size() - 1 && pct >= 0 && pct < 100,
                "SUPERCHIP_HBM_RESERVE must be a byte count (2G) or a percentage of the hbm "
                "budget below 100 (20%); got '", reserve, "'.");
    cfg.hbm_reserve_fraction = pct / 100.0;
  } else if (!reserve.empty()) {
    cfg.hbm_reserve_bytes = parse_bytes(reserve, "SUPERCHIP_HBM_RESERVE");
    if (cfg.hbm_reserve_bytes == 0) cfg.hbm_reserve_fraction = 0.0;
  }
  const std::string host = env_or("SUPERCHIP_HOST_BYTES", "");
  cfg.host_capacity = host.empty() ? 0 : parse_bytes(host, "SUPERCHIP_HOST_BYTES");
  const std::string check = env_or("SUPERCHIP_HOST_MEMORY_CHECK", "1");
  TORCH_CHECK(check == "0" || check == "1",
              "SUPERCHIP_HOST_MEMORY_CHECK must be 1 (refuse host memory the machine cannot "
              "hold, the default) or 0 (map it anyway); got '", check, "'.");
  cfg.check_host_memory = check == "1";
  const Topology& topo = Topology::get();
  cfg.numa_node = topo.nodes()[topo.nearest_node(cuda_pci_bus_id(cfg.cuda ? index : -1))].os_index;
  cfg.pin_host = cfg.cuda;
  if (cfg.cuda) {
    cfg.release_foreign_cache = [] {
      try {
        c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache();
      } catch (...) {
      }
    };
  }
  // Intentionally leaked: tensors may be freed during interpreter teardown, after static
  // destructors would have run.
  auto* m = new MemoryManager(cfg);
  managers[index].store(m, std::memory_order_release);
  return *m;
}

}  // namespace superchip
