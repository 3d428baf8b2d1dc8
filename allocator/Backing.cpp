#include "allocator/Backing.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef SUPERCHIP_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
#endif

namespace superchip {

#ifdef SUPERCHIP_HAVE_CUDA
namespace detail {
void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return;
  // Clears the error so that it does not resurface in an unrelated later call.
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("superchip: CUDA call ") + call + " failed at " + file +
                           ":" + std::to_string(line) + ": " + cudaGetErrorString(err));
}
}  // namespace detail
#endif

namespace {

// ---- NUMA binding ----

#ifdef SUPERCHIP_HAVE_NUMA
bool numa_usable() noexcept {
  // numa_available() must precede every other libnuma call; its answer never changes.
  static const bool usable = numa_available() >= 0;
  return usable;
}
#endif

// Asks the kernel to place the pages of [ptr, ptr + bytes) on `node`. Best effort: without
// libnuma, on a kernel that refuses, or for an unknown node the memory stays unbound.
void bind_to_node(void* ptr, size_t bytes, int node) noexcept {
#ifdef SUPERCHIP_HAVE_NUMA
  if (node < 0 || !numa_usable() || node > numa_max_node()) return;
  constexpr size_t kBitsPerWord = sizeof(unsigned long) * 8;
  std::vector<unsigned long> mask(static_cast<size_t>(node) / kBitsPerWord + 1, 0);
  mask[static_cast<size_t>(node) / kBitsPerWord] |= 1UL << (static_cast<size_t>(node) % kBitsPerWord);
  // MPOL_PREFERRED rather than MPOL_BIND: when the node is full the kernel places pages
  // elsewhere (slower) instead of OOM-killing the process on first touch.
  (void)mbind(ptr, bytes, MPOL_PREFERRED, mask.data(), mask.size() * kBitsPerWord + 1, 0);
#else
  (void)ptr;
  (void)bytes;
  (void)node;
#endif
}

// ---- host memory (host tier and the emulated hbm pool) ----

class HostBacking final : public Backing {
 public:
  HostBacking(int numa_node, bool pin, const char* name)
      : numa_node_(numa_node), pin_(pin), name_(name) {}

  RawBlock allocate(size_t bytes) override {
    RawBlock block;
    block.bytes = bytes;
    if (bytes >= kMmapThreshold || pin_) {
      // mmap gives page-aligned memory that is only committed when touched, and a range
      // of its own that mbind and cudaHostRegister can act on. With a GPU every host block
      // is pinned, small ones too: a forwarded CUDA kernel or a tail-bucket step reads
      // host-tier operands in place, and pageable memory there is an illegal address
      // (seen on an H100: the optimizer state of small parameters).
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return RawBlock{};
      block.ptr = p;
      block.mapped = true;
      bind_to_node(p, bytes, numa_node_);
      if (pin_) block.pinned = try_pin(p, bytes);
    } else {
      void* p = nullptr;
      if (posix_memalign(&p, kBlockAlignment, bytes) != 0) return RawBlock{};
      block.ptr = p;
    }
    return block;
  }

  void release(const RawBlock& block) noexcept override {
    if (block.ptr == nullptr) return;
#ifdef SUPERCHIP_HAVE_CUDA
    if (block.pinned) {
      try {
        SUPERCHIP_CUDA_CHECK(cudaHostUnregister(block.ptr));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
      }
    }
#endif
    if (block.mapped) {
      if (munmap(block.ptr, block.bytes) != 0) {
        std::fprintf(stderr, "superchip: munmap(%p, %zu) failed: errno %d\n", block.ptr,
                     block.bytes, errno);
      }
    } else {
      std::free(block.ptr);
    }
  }

  const char* name() const noexcept override { return name_; }

 private:
  // Pinning is an optimisation (direct DMA); pageable memory still works, so a failure
  // (no GPU, RLIMIT_MEMLOCK) is reported once and the block stays pageable.
  bool try_pin(void* ptr, size_t bytes) noexcept {
#ifdef SUPERCHIP_HAVE_CUDA
    try {
      SUPERCHIP_CUDA_CHECK(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
      return true;
    } catch (const std::exception& e) {
      if (!warned_pin_) {
        std::fprintf(stderr, "%s; host-tier memory stays pageable\n", e.what());
        warned_pin_ = true;
      }
    }
#else
    (void)ptr;
    (void)bytes;
#endif
    return false;
  }

  int numa_node_;
  bool pin_;
  const char* name_;
  bool warned_pin_ = false;
};

// ---- CUDA device memory ----

#ifdef SUPERCHIP_HAVE_CUDA

class CudaBacking final : public Backing {
 public:
  CudaBacking(int device, void (*release_foreign)()) : device_(device), release_foreign_(release_foreign) {
    int count = 0;
    SUPERCHIP_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count) {
      throw std::invalid_argument("superchip: MemoryConfig.device_index is " +
                                  std::to_string(device) + " but only " + std::to_string(count) +
                                  " CUDA device(s) are visible");
    }
    name_ = "cudaMalloc on device " + std::to_string(device);
  }

  RawBlock allocate(size_t bytes) override {
    DeviceScope scope(device_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it so the retry starts clean
      return RawBlock{};
    }
    SUPERCHIP_CUDA_CHECK(err);
    RawBlock block;
    block.ptr = p;
    block.bytes = bytes;
    return block;
  }

  bool release_foreign() noexcept override {
    if (release_foreign_ == nullptr) return false;
    release_foreign_();
    return true;
  }

  void release(const RawBlock& block) noexcept override {
    if (block.ptr == nullptr) return;
    cudaError_t err = cudaFree(block.ptr);
    // At process exit the runtime may already be gone, and with it the memory.
    if (err == cudaErrorCudartUnloading) return;
    try {
      SUPERCHIP_CUDA_CHECK(err);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }

  const char* name() const noexcept override { return name_.c_str(); }

 private:
  int device_;
  void (*release_foreign_)() = nullptr;
  std::string name_;
};
#endif

}  // namespace

std::unique_ptr<Backing> make_hbm_backing(const MemoryConfig& config) {
  if (!config.cuda) return std::make_unique<HostBacking>(-1, false, "host memory (emulated hbm)");
#ifdef SUPERCHIP_HAVE_CUDA
  return std::make_unique<CudaBacking>(config.device_index, config.release_foreign_cache);
#else
  throw std::invalid_argument(
      "superchip: MemoryConfig.cuda is true but this build has no CUDA support "
      "(rebuild with a CUDA toolkit and SUPERCHIP_WITH_CUDA=AUTO or ON)");
#endif
}

std::unique_ptr<Backing> make_host_backing(const MemoryConfig& config) {
  return std::make_unique<HostBacking>(config.numa_node, config.pin_host, "host memory");
}

}  // namespace superchip
