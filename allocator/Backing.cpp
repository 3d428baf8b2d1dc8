#include "allocator/Backing.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/HostMemory.h"

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

// Note [The machine's memory]
// Host memory is mapped lazily: mmap of more than the machine has succeeds (overcommit), and
// the kernel finds out when the pages are first touched, by killing the process (the OOM
// killer, or the memory cgroup's). A host tier without a budget, the default, therefore never
// said "out of memory": a model too large for the machine placed its weights and optimizer
// state block by block until the process died with SIGKILL in the middle of `.to()` or of the
// first step (measured: a 1.5 GiB memory cgroup, 128 MiB host-tier tensors filled one by one,
// killed at the tenth). So before a block of kMmapThreshold or more is mapped, the backing
// reads what the machine can still give this process (HostMemory.h: MemAvailable, bounded by
// the memory cgroup) and refuses the block, a null block like any backing out of memory, when
// it does not fit beside a reserve (host_memory_reserve: limit / 32 within [256 MiB, 2 GiB])
// kept for the rest of the process. The tier then releases its cache, which counts as used,
// and asks again; a second refusal raises OutOfTierMemory naming the machine's figures, so
// placement spills, the engine abandons a speculation and the user reads what was wrong, as
// for a budget. Limits, said in the README: the figures are the kernel's at the moment of the
// request, less what superchip's own blocks will still take (Note [Blocks mapped and not
// yet written]); memory other allocators (torch's CPU tensors) take later is not foreseen;
// swap is not counted (training on swap is not a working configuration),
// SUPERCHIP_HOST_MEMORY_CHECK=0 turns the check off. Smaller blocks are not checked. A read
// takes about 40 us (/proc/meminfo and the cgroup's files; v1's memory.stat is the dear one),
// so figures are reused for 50 ms less what was mapped since (one reading and one count for
// the whole process, every backing that checks: MachineFigures), and read again before any
// refusal.

// Note [Blocks mapped and not yet written]
// MemAvailable and the cgroup's use count pages, and a mapped block has none until it is
// written: `torch.empty` of a large buffer filled later, or a cached block reused, took
// nothing from the figures, so every later request was measured against memory already
// promised (measured: three blocks of 40% of the headroom, 60 ms apart, all granted).
// Every checked block therefore stays in a process-wide list (both backings: host tier and
// emulated hbm) until its pages are all resident, and a fresh read subtracts the pages of
// the list that are not (mincore(2); pages swapped out count as not written, which errs on
// the side of refusing). Blocks leave the list once written through, or when released, so
// the walk is over blocks still being filled or never filled: at most a few.

class UnwrittenBlocks {
 public:
  static UnwrittenBlocks& instance() {
    static UnwrittenBlocks* blocks = new UnwrittenBlocks();  // used by release() at exit
    return *blocks;
  }

  void add(void* ptr, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.emplace_back(static_cast<char*>(ptr), bytes);
  }

  void remove(void* ptr) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.erase(std::remove_if(blocks_.begin(), blocks_.end(),
                                 [ptr](const auto& b) { return b.first == ptr; }),
                  blocks_.end());
  }

  // Bytes of the listed blocks not resident yet; forgets the blocks that are all resident.
  size_t bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t total = 0;
    std::vector<std::pair<char*, size_t>> keep;
    for (const auto& [ptr, size] : blocks_) {
      const std::optional<size_t> missing = not_resident(ptr, size);
      if (missing && *missing > 0) {
        total += *missing;
        keep.emplace_back(ptr, size);
      }
      // mincore failing (never expected on our own mapping) drops the block, as if written.
    }
    blocks_ = std::move(keep);
    return total;
  }

 private:
  std::optional<size_t> not_resident(char* ptr, size_t size) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    constexpr size_t kChunkPages = 16384;  // 64 MiB of 4 KiB pages per call
    vec_.resize(kChunkPages);
    size_t missing = 0;
    for (size_t off = 0; off < size; off += kChunkPages * page) {
      const size_t len = std::min(size - off, kChunkPages * page);
      if (mincore(ptr + off, len, vec_.data()) != 0) return std::nullopt;
      const size_t pages = (len + page - 1) / page;
      for (size_t i = 0; i < pages; ++i) {
        if ((vec_[i] & 1) == 0) missing += std::min(page, len - i * page);
      }
    }
    return missing;
  }

  std::mutex mu_;
  std::vector<std::pair<char*, size_t>> blocks_;
  std::vector<unsigned char> vec_;
};

// The figures the check reads, one copy for the process: every backing that checks (each
// device's host tier and emulated hbm) grants against the same reading and the same count of
// what was mapped since, so two cannot each grant the whole headroom within kFresh.
class MachineFigures {
 public:
  static MachineFigures& instance() {
    static MachineFigures* figures = new MachineFigures();
    return *figures;
  }

  // The figures read are kept for kFresh, less what was mapped since: a request that fits
  // them does not read again, one that does not is decided on a fresh read.
  bool holds(size_t bytes, std::string* shortage) {
    std::lock_guard<std::mutex> lock(mu_);
    if (unreadable_) return true;
    const auto now = std::chrono::steady_clock::now();
    if (figures_ && now - read_at_ < kFresh && fits(*figures_, mapped_since_read_ + bytes)) {
      mapped_since_read_ += bytes;
      return true;
    }
    // The blocks before the figures: a page written between the two then counts twice, which
    // refuses early, rather than not at all.
    const size_t unwritten = UnwrittenBlocks::instance().bytes();
    figures_ = read_host_memory();
    read_at_ = now;
    mapped_since_read_ = unwritten;
    if (!figures_) {
      // Not Linux, or no /proc: nothing to check against, for good. A read that failed for
      // another reason (out of file descriptors) lets this block through and reads again.
      unreadable_ = ::access("/proc/meminfo", F_OK) != 0 && errno == ENOENT;
      return true;
    }
    if (fits(*figures_, unwritten + bytes)) {
      mapped_since_read_ = unwritten + bytes;
      return true;
    }
    *shortage = "this machine cannot hold it: " + figures_->describe();
    if (unwritten > 0) {
      *shortage += ", less " + format_bytes(unwritten) +
                   " that superchip's blocks will take when their pages are first written";
    }
    *shortage += ", of which superchip leaves " +
                 format_bytes(host_memory_reserve(figures_->limit())) +
                 " free for the rest of the process";
    return false;
  }

 private:
  static bool fits(const HostMemory& m, size_t bytes) noexcept {
    const size_t reserve = host_memory_reserve(m.limit());
    const size_t room = m.headroom();
    return room >= reserve && bytes <= room - reserve;
  }

  static constexpr std::chrono::milliseconds kFresh{50};
  std::mutex mu_;
  std::optional<HostMemory> figures_;
  std::chrono::steady_clock::time_point read_at_{};
  size_t mapped_since_read_ = 0;
  bool unreadable_ = false;
};

class HostBacking final : public Backing {
 public:
  HostBacking(int numa_node, bool pin, const char* name, bool check_memory)
      : numa_node_(numa_node), pin_(pin), check_memory_(check_memory), name_(name) {}

  RawBlock allocate(size_t bytes) override {
    RawBlock block;
    block.bytes = bytes;
    if (check_memory_ && bytes >= kMmapThreshold && !machine_holds(bytes)) return RawBlock{};
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
      if (check_memory_ && bytes >= kMmapThreshold) {
        try {
          UnwrittenBlocks::instance().add(p, bytes);
        } catch (...) {
          release(block);
          throw;
        }
      }
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
      UnwrittenBlocks::instance().remove(block.ptr);  // before the range can be mapped again
      if (munmap(block.ptr, block.bytes) != 0) {
        std::fprintf(stderr, "superchip: munmap(%p, %zu) failed: errno %d\n", block.ptr,
                     block.bytes, errno);
      }
    } else {
      std::free(block.ptr);
    }
  }

  const char* name() const noexcept override { return name_; }

  std::string shortage() const override { return shortage_; }

 private:
  // Whether the machine can give this process `bytes` more and keep the reserve (Note [The
  // machine's memory]); when not, shortage_ says why. True when the figures cannot be read.
  bool machine_holds(size_t bytes) {
    shortage_.clear();
    return MachineFigures::instance().holds(bytes, &shortage_);
  }

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
  bool check_memory_;
  const char* name_;
  bool warned_pin_ = false;
  std::string shortage_;
};

}  // namespace

size_t host_blocks_unwritten_bytes() { return UnwrittenBlocks::instance().bytes(); }

namespace {

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
  if (!config.cuda) {
    return std::make_unique<HostBacking>(-1, false, "host memory (emulated hbm)",
                                         config.check_host_memory);
  }
#ifdef SUPERCHIP_HAVE_CUDA
  return std::make_unique<CudaBacking>(config.device_index, config.release_foreign_cache);
#else
  throw std::invalid_argument(
      "superchip: MemoryConfig.cuda is true but this build has no CUDA support "
      "(rebuild with a CUDA toolkit and SUPERCHIP_WITH_CUDA=AUTO or ON)");
#endif
}

std::unique_ptr<Backing> make_host_backing(const MemoryConfig& config) {
  return std::make_unique<HostBacking>(config.numa_node, config.pin_host, "host memory",
                                       config.check_host_memory);
}

}  // namespace superchip
