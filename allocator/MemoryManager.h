// MemoryManager: the two-tier memory (hbm + host) of one superchip device.
// Invariants (per tier, checked by check_invariants()):
//   allocated_bytes = sum(live block sizes) + external_bytes
//   reserved_bytes  = sum(backing blocks, live or cached) + external_bytes >= allocated_bytes
//   reserved_bytes <= capacity_bytes (capacity 0 = unlimited)
// Thread-safety: every public method may be called from any thread; each tier has its own
// mutex. Nothing here takes the GIL or includes torch. free()/release_external() never throw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace superchip {

enum class Tier : uint8_t { kHbm = 0, kHost = 1 };
constexpr int kNumTiers = 2;

// "hbm" / "host".
const char* tier_name(Tier tier) noexcept;
// Inverse of tier_name; nullopt for anything else.
std::optional<Tier> parse_tier(std::string_view name) noexcept;

// Exact statistics of one tier, in bytes unless named otherwise.
struct TierStats {
  int64_t allocated_bytes = 0;       // bytes in live blocks (rounded sizes) + external bytes
  int64_t requested_bytes = 0;       // bytes asked for by live allocations (unrounded) + external
  int64_t reserved_bytes = 0;        // bytes obtained from the backing (live + cached) + external
  int64_t peak_allocated_bytes = 0;  // max of allocated_bytes since the last reset_peak()
  int64_t peak_reserved_bytes = 0;   // max of reserved_bytes since the last reset_peak()
  int64_t peak_requested_bytes = 0;  // max of requested_bytes since the last reset_peak()
  int64_t peak_active_allocations = 0;  // max of active_allocations since the last reset_peak()
  int64_t capacity_bytes = 0;        // budget; 0 = unlimited
  int64_t external_bytes = 0;        // adopted memory accounted through account_external()
  int64_t active_allocations = 0;    // live blocks + live external accounts
  int64_t num_allocs = 0;            // cumulative allocate() + account_external() calls
  int64_t num_frees = 0;             // cumulative free() + release_external() calls
  int64_t num_cache_hits = 0;        // allocations served from the cache
  int64_t num_ooms = 0;              // OutOfTierMemory errors raised
  int64_t num_spills = 0;            // host only: allocate_placed() requests hbm could not take
  // Cumulative since construction or reset_accumulated(), as torch.cuda's "allocated" and
  // "freed" figures (external accounts count as allocations, blocks and backing segments):
  int64_t allocated_bytes_total = 0;  // rounded bytes of every allocation
  int64_t freed_bytes_total = 0;      // rounded bytes of every free
  int64_t requested_bytes_total = 0;  // bytes asked for by every allocation
  int64_t requested_freed_total = 0;  // bytes asked for by every freed allocation
  int64_t reserved_bytes_total = 0;   // bytes obtained from the backing
  int64_t released_bytes_total = 0;   // bytes given back to the backing
  int64_t num_segment_allocs = 0;     // blocks obtained from the backing
  int64_t num_segment_frees = 0;      // blocks given back to the backing
  int64_t segments = 0;               // blocks held from the backing (live + cached) + external
  int64_t peak_segments = 0;          // max of segments since the last reset_peak()
};

// Raised when a tier cannot satisfy a request even after releasing its cache. The
// message names the tier, the device, the request, the budget and what is in use, and
// says what the user can do. The manager's state is unchanged by a failed request.
class OutOfTierMemory : public std::runtime_error {
 public:
  OutOfTierMemory(const std::string& what, Tier tier, size_t requested, bool system = false,
                  std::string state = {}, std::string advice = {})
      : std::runtime_error(what), tier_(tier), requested_(requested), system_(system),
        state_(std::move(state)), advice_(std::move(advice)) {}
  Tier tier() const noexcept { return tier_; }
  size_t requested() const noexcept { return requested_; }
  // True when the memory itself ran out (cudaMalloc, the machine's memory) before the budget:
  // raising the budget would not help.
  bool system() const noexcept { return system_; }
  // The parts of what(): the tier's state ("capacity ..., ... cached[; why the memory ran
  // out]") and the advice, for a message that names two tiers once each.
  const std::string& state() const noexcept { return state_; }
  const std::string& advice() const noexcept { return advice_; }

 private:
  Tier tier_;
  size_t requested_;
  bool system_;
  std::string state_;
  std::string advice_;
};

struct MemoryConfig {
  int device_index = 0;
  // hbm backing: false = emulated (a host-memory pool), true = cudaMalloc on device_index
  // (only in builds with SUPERCHIP_HAVE_CUDA; otherwise the constructor throws).
  bool cuda = false;
  size_t hbm_capacity = 0;   // bytes; 0 = unlimited (emulated default is chosen by the caller)
  size_t host_capacity = 0;  // bytes; 0 = unlimited
  int numa_node = -1;        // NUMA node for host-tier memory; -1 = no binding
  bool pin_host = false;     // cudaHostRegister large host blocks (CUDA builds only)
  // Host-memory blocks of 1 MiB or more (host tier, emulated hbm) are refused when the
  // machine (MemAvailable, the memory cgroup) cannot hold them beside a reserve, instead of
  // being mapped for the kernel to kill the process on first touch (Note [The machine's
  // memory] in Backing.cpp).
  bool check_host_memory = true;
  // hbm kept free of weights for activations (Note [Placement]): reserve_bytes when set
  // (> 0), else reserve_fraction of the hbm capacity. Only applies to a limited hbm.
  size_t hbm_reserve_bytes = 0;
  double hbm_reserve_fraction = 0.2;
  // Called once when cudaMalloc for hbm fails, before it is retried: another allocator sharing
  // the GPU (torch's CUDA caching allocator, which holds forwarded kernels' freed outputs)
  // gives back what it caches. Must not call into this manager.
  void (*release_foreign_cache)() = nullptr;
};

class MemoryManager {
 public:
  explicit MemoryManager(const MemoryConfig& config);
  ~MemoryManager();
  MemoryManager(const MemoryManager&) = delete;
  MemoryManager& operator=(const MemoryManager&) = delete;

  // Returns a block of at least nbytes (64-byte aligned) in `tier`, from the cache when a
  // fitting block is free. nbytes == 0 returns nullptr and changes no statistic.
  // Throws OutOfTierMemory when the tier's budget cannot hold it after empty_cache().
  void* allocate(size_t nbytes, Tier tier);
  // As allocate(), but nullptr instead of an error when the tier cannot hold nbytes (no error
  // counted, nothing changed): for a caller with a fallback (the weight streamer's staging).
  void* try_allocate(size_t nbytes, Tier tier) noexcept;
  // A block for a tensor that may live in either tier (Note [Placement] in MemoryManager.cpp):
  // in hbm while it can hold nbytes without hbm's allocated bytes passing `hbm_limit`
  // (0 = the capacity), else in host (a spill, counted in host's num_spills), else in hbm past
  // the limit. Throws OutOfTierMemory naming both tiers when neither can hold it.
  struct Placed {
    void* ptr;
    Tier tier;
  };
  Placed allocate_placed(size_t nbytes, size_t hbm_limit = 0);
  // Whether a block of nbytes may be placed in host for a kernel to read: always emulated;
  // with a GPU only blocks >= kMmapThreshold. The host backing now pins small blocks too
  // (a GPU kernel cannot read pageable host memory everywhere); widening this rule to them
  // waits for a GPU run that measures it.
  bool host_placeable(size_t nbytes) const noexcept;
  // The hbm_limit for weights: hbm capacity minus the activation reserve; 0 when hbm is
  // unlimited (no reserve to keep).
  size_t weights_limit() const noexcept;
  // Returns a block from allocate() to its tier's cache. nullptr is ignored. Never throws;
  // a pointer this manager does not own is reported to stderr and ignored.
  void free(void* ptr) noexcept;

  // Accounts nbytes of memory that some other allocator owns (e.g. an output a forwarded
  // kernel allocated) as in use in `tier`. Throws OutOfTierMemory (state unchanged) when the
  // budget cannot hold it after releasing the cache.
  void account_external(Tier tier, size_t nbytes);
  void release_external(Tier tier, size_t nbytes) noexcept;
  // As account_external(), but false (nothing changed, no error counted) when it cannot.
  bool try_account_external(Tier tier, size_t nbytes);
  // account_external() for memory that may count in either tier (an emulated executor's
  // output: host memory either way): hbm while it can hold it, else host (a spill). Throws
  // OutOfTierMemory naming both tiers when neither can. Returns the tier charged.
  Tier account_external_placed(size_t nbytes);

  // Tier of a pointer returned by allocate(), nullopt for any other pointer.
  std::optional<Tier> tier_of(const void* ptr) const noexcept;
  // Usable size of a block returned by allocate() (>= the request); 0 if not ours.
  size_t block_size(const void* ptr) const noexcept;

  // Copies nbytes between any two pointers this device can address (either tier, or
  // plain host memory). Synchronous. With CUDA it goes through cudaMemcpy.
  void copy(void* dst, const void* src, size_t nbytes) const;

  TierStats stats(Tier tier) const noexcept;
  // Returns every cached (free) block of both tiers to its backing.
  void empty_cache() noexcept;
  // The same for one tier; returns the bytes given back.
  size_t empty_cache(Tier tier) noexcept;
  void reset_peak() noexcept;         // peaks := current values
  void reset_accumulated() noexcept;  // num_allocs, num_frees, num_cache_hits, num_ooms, the totals := 0
  // Changes a tier's budget. Throws std::invalid_argument if below the bytes in use.
  void set_capacity(Tier tier, size_t capacity_bytes);

  const MemoryConfig& config() const noexcept;

  // Debug walker: checks the invariants above and the block lists; throws std::logic_error
  // naming the first violated invariant. Each tier is checked under its lock; the check that
  // no block is in both tiers is exact only while no other thread allocates or frees.
  void check_invariants() const;

 private:
  [[noreturn]] void throw_both_full(size_t nbytes, const OutOfTierMemory& host_error) const;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Human-readable byte count ("1.50 GiB"), used in error messages.
std::string format_bytes(size_t nbytes);

}  // namespace superchip
