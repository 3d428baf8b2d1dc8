// TierAllocator: the caching allocator of one tier (hbm or host) over one Backing.
// Invariants (S = stats_, live/cached = the block lists, checked by check_invariants()):
//   S.allocated_bytes = sum(live sizes) + S.external_bytes
//   S.requested_bytes = sum(live requests) + S.external_bytes
//   S.reserved_bytes  = sum(live sizes) + sum(cached sizes) + S.external_bytes
//   S.capacity_bytes == 0  or  S.reserved_bytes <= S.capacity_bytes
//   S.active_allocations = |live| + live external accounts;  live and cached are disjoint
// Thread-safety: every method locks the tier's mutex; the Backing is only used under it
// (but for Backing::release_foreign(), called without it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/Backing.h"
#include "allocator/MemoryManager.h"

namespace superchip {

// Note [Size rounding and reuse]
// A request of n > 0 bytes gets a block of
//   round_size(n) = ceil(n / 512) * 512             if n <  1 MiB
//                 = ceil(n / 128 KiB) * 128 KiB     if n >= 1 MiB
// (at most 511 B or 1/8 of the request wasted; round_size(round_size(n)) = round_size(n)).
// A cached block of size s serves a request rounded to r iff  r <= s <= r + r / 4,  and the
// smallest such s is taken (best fit). Blocks are never split or merged: bounding the waste
// keeps a huge cached block from being pinned down by a small tensor.
constexpr size_t kSmallGranularity = 512;
constexpr size_t kLargeGranularity = size_t{128} << 10;
constexpr size_t kLargeThreshold = size_t{1} << 20;

class TierAllocator {
 public:
  // capacity_bytes: budget, 0 = unlimited. device_index only names the device in messages.
  TierAllocator(Tier tier, int device_index, size_t capacity_bytes,
                std::unique_ptr<Backing> backing);
  // Returns every block, cached or still live, to the backing.
  ~TierAllocator();
  TierAllocator(const TierAllocator&) = delete;
  TierAllocator& operator=(const TierAllocator&) = delete;

  static size_t round_size(size_t nbytes) noexcept;

  // See MemoryManager::allocate. On a miss that would exceed the budget, cached blocks are
  // released largest first until the block fits; if it cannot fit even with an empty
  // cache, throws OutOfTierMemory without changing anything but num_ooms. If the backing
  // itself is out of memory, the whole cache is released and the backing asked once more;
  // if that also fails, OutOfTierMemory is thrown (the released cache stays released).
  // Other backing failures (a CUDA error) propagate as std::runtime_error.
  void* allocate(size_t nbytes);
  // As allocate(), but returns nullptr instead of throwing when the budget or the backing
  // cannot hold the request (no error counted, nothing changed): for a caller with a fallback.
  void* try_allocate(size_t nbytes);
  // Returns ptr to the cache. False (and nothing changes) when ptr is not a live block here.
  bool free(void* ptr) noexcept;

  // nbytes == 0 is a no-op. Same budget rule and errors as allocate, without rounding.
  void account_external(size_t nbytes);
  // As account_external(), but returns false (no error counted, nothing changed) when the
  // budget cannot hold it.
  bool try_account_external(size_t nbytes);
  // nbytes == 0 is a no-op. Releasing more than is accounted is reported to stderr and
  // clamped so that the statistics stay non-negative.
  void release_external(size_t nbytes) noexcept;

  bool owns(const void* ptr) const noexcept;
  // Size of the live block at ptr, 0 if ptr is not a live block here.
  size_t block_size(const void* ptr) const noexcept;

  TierStats stats() const noexcept;
  // Returns every cached block to the backing; the bytes given back.
  size_t empty_cache() noexcept;
  void reset_peak() noexcept;
  void reset_accumulated() noexcept;
  // Throws std::invalid_argument if capacity_bytes != 0 and below allocated_bytes;
  // otherwise releases cached blocks (largest first) until reserved_bytes fits.
  void set_capacity(size_t capacity_bytes);

  // Throws std::logic_error naming the first violated invariant.
  void check_invariants() const;
  // Start addresses of every block (live and cached), for cross-tier checks.
  std::vector<const void*> block_pointers() const;

 private:
  struct LiveBlock {
    RawBlock raw;
    size_t requested = 0;
  };

  // All private helpers expect mutex_ to be held.
  // Throws OutOfTierMemory unless `bytes` more can be reserved, releasing cache if needed.
  void* allocate_impl(size_t nbytes, bool quiet);
  bool account_locked(size_t nbytes);  // under mutex_: false (nothing changed) when over budget
  // False (nothing changed) when the budget cannot hold `bytes` even with the cache released.
  bool make_room(size_t bytes);
  // backing_exhausted: the backing, not the budget, had no room (its shortage() says why).
  // `shortage`: the backing's reason when backing_exhausted (Backing::shortage()).
  [[noreturn]] void throw_oom(size_t requested, bool backing_exhausted, const std::string& shortage = {});
  void release_cached(std::multimap<size_t, RawBlock>::iterator it) noexcept;
  void release_all_cached() noexcept;
  void grow(int64_t allocated, int64_t requested, int64_t reserved) noexcept;

  const Tier tier_;
  const int device_index_;
  std::unique_ptr<Backing> backing_;

  mutable std::mutex mutex_;
  TierStats stats_;
  int64_t external_accounts_ = 0;
  std::unordered_map<void*, LiveBlock> live_;
  std::multimap<size_t, RawBlock> cached_;  // by size, for best fit
};

}  // namespace superchip
