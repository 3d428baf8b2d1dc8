// Backing: where a tier's raw memory comes from (cudaMalloc, or host memory that may be
// NUMA-bound and CUDA-registered). No caching and no accounting here: TierAllocator does both.
// allocate() returns a null block when the system is out of memory (so the caller can drop
// its cache and retry) and throws std::runtime_error for any other failure; release() never
// throws. Not thread-safe: each Backing is used under its TierAllocator's mutex (but for
// release_foreign()).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "allocator/MemoryManager.h"

#ifdef SUPERCHIP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace superchip {

// Host blocks of at least this size are mmap'd (and so may be NUMA-bound and pinned);
// smaller ones come from posix_memalign.
constexpr size_t kMmapThreshold = size_t{1} << 20;
// Alignment of every block a Backing returns.
constexpr size_t kBlockAlignment = 64;

struct RawBlock {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool mapped = false;  // from mmap (munmap to release) rather than posix_memalign
  bool pinned = false;  // cudaHostRegister'ed (cudaHostUnregister before release)
};

class Backing {
 public:
  virtual ~Backing() = default;
  // bytes > 0. Returns {nullptr} when out of memory; throws for other failures.
  virtual RawBlock allocate(size_t bytes) = 0;
  // Gives a block from allocate() back to the system. Errors are reported to stderr.
  virtual void release(const RawBlock& block) noexcept = 0;
  // What the memory is, for error messages ("cudaMalloc on device 0", "host memory").
  virtual const char* name() const noexcept = 0;
  // Why the last allocate() returned a null block, for the error message, when the backing
  // knows more than "out of memory" (the host backing: the machine's figures); empty otherwise.
  virtual std::string shortage() const { return {}; }
  // Asks another allocator of the same memory to give back what it caches (CUDA's caching
  // allocator, MemoryConfig.release_foreign_cache); whether one was asked. Called WITHOUT the
  // tier's mutex (the other allocator takes its own locks, and may take the GIL), so unlike
  // the rest of a Backing it must be safe to call from any thread at any time.
  virtual bool release_foreign() noexcept { return false; }
};

// hbm tier: cudaMalloc on config.device_index when config.cuda, else host memory (the
// emulated pool). Throws std::invalid_argument when config.cuda but CUDA is not built in,
// or when the device index is out of range; std::runtime_error when CUDA cannot start.
std::unique_ptr<Backing> make_hbm_backing(const MemoryConfig& config);
// host tier: host memory, mmap'd blocks bound to config.numa_node (when libnuma works)
// and registered with CUDA when config.pin_host (CUDA builds only; falls back to pageable).
// With config.check_host_memory, a block of kMmapThreshold or more that the machine cannot
// hold is refused (a null block) before it is mapped (Note [The machine's memory] in
// Backing.cpp); so is one of the emulated hbm pool.
std::unique_ptr<Backing> make_host_backing(const MemoryConfig& config);

// Bytes of the checked host blocks (both backings) whose pages are not resident yet, which
// the machine check counts as taken (Note [Blocks mapped and not yet written] in Backing.cpp).
size_t host_blocks_unwritten_bytes();

#ifdef SUPERCHIP_HAVE_CUDA
namespace detail {
// Throws std::runtime_error naming the call, file:line and cudaGetErrorString(err).
void cuda_check(cudaError_t err, const char* call, const char* file, int line);
}  // namespace detail

// The one way superchip checks a CUDA runtime call (see STYLE.md, habit 6).
#define SUPERCHIP_CUDA_CHECK(call) ::superchip::detail::cuda_check((call), #call, __FILE__, __LINE__)

// Makes `device` this CUDA runtime's current device for the scope, so that the caller's
// current device is untouched (superchip's runtime is linked statically: its current device
// is its own, not torch's).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    SUPERCHIP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) SUPERCHIP_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() {
    // A failure here would leave the caller on our device; nothing better can be done.
    (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};
#endif

}  // namespace superchip
