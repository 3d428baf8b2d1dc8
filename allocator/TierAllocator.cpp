#include "allocator/TierAllocator.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace superchip {

namespace {

// Requests above this are refused outright so that rounding and the byte counters
// (int64_t) can never overflow.
constexpr size_t kMaxRequest = size_t{1} << 60;

int64_t as_i64(size_t n) { return static_cast<int64_t>(n); }

// Reuse rule of Note [Size rounding and reuse]: a cached block of size s serves a request
// rounded to r iff r <= s <= r + r / 4.
size_t max_reusable_size(size_t rounded) { return rounded + rounded / 4; }

}  // namespace

TierAllocator::TierAllocator(Tier tier, int device_index, size_t capacity_bytes,
                             std::unique_ptr<Backing> backing)
    : tier_(tier), device_index_(device_index), backing_(std::move(backing)) {
  stats_.capacity_bytes = as_i64(capacity_bytes);
}

TierAllocator::~TierAllocator() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_all_cached();
  for (auto& entry : live_) backing_->release(entry.second.raw);
}

size_t TierAllocator::round_size(size_t nbytes) noexcept {
  const size_t granularity = nbytes < kLargeThreshold ? kSmallGranularity : kLargeGranularity;
  return (nbytes + granularity - 1) / granularity * granularity;
}

// ---- allocation ----

void* TierAllocator::allocate(size_t nbytes) { return allocate_impl(nbytes, /*quiet=*/false); }

void* TierAllocator::try_allocate(size_t nbytes) { return allocate_impl(nbytes, /*quiet=*/true); }

void* TierAllocator::allocate_impl(size_t nbytes, bool quiet) {
  if (nbytes == 0) return nullptr;
  // Out of system memory with nothing of ours left cached: another allocator of the same memory
  // (CUDA's caching allocator) may hold what is missing. It is asked once, outside our mutex
  // (it takes its own locks, and may take the GIL to record a trace; a thread holding the GIL
  // may be freeing a block of ours), and the request starts over.
  for (bool foreign_released = false;; foreign_released = true) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (nbytes > kMaxRequest) {
      if (quiet) return nullptr;
      throw_oom(nbytes, false);
    }
    const size_t rounded = round_size(nbytes);

    auto hit = cached_.lower_bound(rounded);
    if (hit != cached_.end() && hit->first <= max_reusable_size(rounded)) {
      const RawBlock raw = hit->second;
      live_.emplace(raw.ptr, LiveBlock{raw, nbytes});  // may throw bad_alloc: nothing changed yet
      cached_.erase(hit);
      grow(as_i64(raw.bytes), as_i64(nbytes), 0);
      stats_.num_allocs++;
      stats_.num_cache_hits++;
      return raw.ptr;
    }

    if (!make_room(rounded)) {
      if (quiet) return nullptr;
      throw_oom(nbytes, false);
    }
    RawBlock raw = backing_->allocate(rounded);
    if (raw.ptr == nullptr) {
      // The system ran out before the budget did: what we cache may be what it lacks.
      release_all_cached();
      raw = backing_->allocate(rounded);
    }
    if (raw.ptr == nullptr) {
      // Why, before another thread's request (while the lock is dropped below) can change it.
      const std::string shortage = backing_->shortage();
      if (!foreign_released) {
        lock.unlock();
        if (backing_->release_foreign()) continue;
        lock.lock();
      }
      if (quiet) return nullptr;
      throw_oom(nbytes, true, shortage);
    }
    try {
      live_.emplace(raw.ptr, LiveBlock{raw, nbytes});
    } catch (...) {
      backing_->release(raw);
      throw;
    }
    grow(as_i64(rounded), as_i64(nbytes), as_i64(rounded));
    stats_.num_allocs++;
    return raw.ptr;
  }
}

bool TierAllocator::free(void* ptr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  const LiveBlock block = it->second;
  live_.erase(it);
  stats_.allocated_bytes -= as_i64(block.raw.bytes);
  stats_.requested_bytes -= as_i64(block.requested);
  stats_.active_allocations--;
  stats_.num_frees++;
  stats_.freed_bytes_total += as_i64(block.raw.bytes);
  stats_.requested_freed_total += as_i64(block.requested);
  try {
    cached_.emplace(block.raw.bytes, block.raw);
  } catch (...) {
    // No memory for the cache node: give the block back instead of caching it.
    backing_->release(block.raw);
    stats_.reserved_bytes -= as_i64(block.raw.bytes);
    stats_.released_bytes_total += as_i64(block.raw.bytes);
    stats_.num_segment_frees++;
    stats_.segments--;
  }
  return true;
}

bool TierAllocator::try_account_external(size_t nbytes) {
  if (nbytes == 0) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  return account_locked(nbytes);
}

void TierAllocator::account_external(size_t nbytes) {
  if (nbytes == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!account_locked(nbytes)) throw_oom(nbytes, false);
}

bool TierAllocator::account_locked(size_t nbytes) {
  if (nbytes > kMaxRequest || !make_room(nbytes)) return false;
  grow(as_i64(nbytes), as_i64(nbytes), as_i64(nbytes));
  stats_.external_bytes += as_i64(nbytes);
  external_accounts_++;
  stats_.num_allocs++;
  return true;
}

void TierAllocator::release_external(size_t nbytes) noexcept {
  if (nbytes == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t released = std::min(as_i64(std::min(nbytes, kMaxRequest)), stats_.external_bytes);
  if (released != as_i64(nbytes) || external_accounts_ == 0) {
    std::fprintf(stderr,
                 "superchip: release_external(%s, %zu) but only %lld bytes in %lld account(s) "
                 "are accounted; releasing %lld\n",
                 tier_name(tier_), nbytes, static_cast<long long>(stats_.external_bytes),
                 static_cast<long long>(external_accounts_), static_cast<long long>(released));
  }
  stats_.allocated_bytes -= released;
  stats_.requested_bytes -= released;
  stats_.reserved_bytes -= released;
  stats_.external_bytes -= released;
  if (external_accounts_ > 0) {
    external_accounts_--;
    stats_.active_allocations--;
  }
  stats_.num_frees++;
  stats_.freed_bytes_total += released;
  stats_.requested_freed_total += released;
  stats_.released_bytes_total += released;
  stats_.num_segment_frees++;
  stats_.segments--;
}

// ---- budget ----

bool TierAllocator::make_room(size_t bytes) {
  const int64_t capacity = stats_.capacity_bytes;
  if (capacity == 0) return true;
  // Decide before touching the cache, so that a failed request changes nothing.
  if (stats_.allocated_bytes + as_i64(bytes) > capacity) return false;
  // Largest first: few releases free many bytes, and the small blocks that churn stay.
  while (stats_.reserved_bytes + as_i64(bytes) > capacity) release_cached(std::prev(cached_.end()));
  return true;
}

void TierAllocator::throw_oom(size_t requested, bool backing_exhausted, const std::string& shortage) {
  stats_.num_ooms++;
  const bool hbm = tier_ == Tier::kHbm;
  const int64_t cached = stats_.reserved_bytes - stats_.allocated_bytes;
  std::string state = "capacity " +
                      (stats_.capacity_bytes == 0 ? std::string("unlimited")
                                                  : format_bytes(size_t(stats_.capacity_bytes))) +
                      ", " + format_bytes(size_t(stats_.allocated_bytes)) + " allocated by tensors, " +
                      format_bytes(size_t(cached)) + " cached";
  std::string advice;
  if (backing_exhausted) {
    // The budget was not the limit, so raising it would not help.
    if (shortage.empty()) {
      state += std::string("; ") + backing_->name() + " has no more free memory";
      advice = "Free tensors";
      if (hbm) advice += ", or move tensors to the host tier with superchip.move_to_tier(t, \"host\")";
      advice += ".";
    } else {
      // The machine's memory (Note [The machine's memory] in Backing.cpp).
      state += "; " + shortage;
      advice = "Free tensors";
      if (hbm) advice += ", move tensors to the host tier with superchip.move_to_tier(t, \"host\")";
      advice += ", stop other processes using this machine's memory, or run where the process has "
                "more memory (a larger memory cgroup limit); SUPERCHIP_HOST_MEMORY_CHECK=0 turns "
                "this check off (memory past it is taken from swap, or the kernel kills the "
                "process).";
    }
  } else {
    advice = "Free tensors, call superchip.empty_cache(), ";
    if (hbm) advice += "move tensors to the host tier with superchip.move_to_tier(t, \"host\"), ";
    advice += std::string("or raise ") + (hbm ? "SUPERCHIP_HBM_BYTES." : "SUPERCHIP_HOST_BYTES.");
  }
  // Note [The words "out of memory."]: the message says "out of memory." as CUDA's ("CUDA out
  // of memory. Tried to allocate ...") and XPU's do, because tools decide by those words whether
  // a smaller batch may fit: accelerate's find_executable_batch_size (Trainer's
  // auto_find_batch_size) retries only when an error's text holds " out of memory.", and with
  // "out of memory in tier ..." it gave up at the first batch size that did not fit.
  const std::string msg = std::string("superchip: out of memory. Tier '") + tier_name(tier_) +
                          "' of superchip:" + std::to_string(device_index_) + " cannot take it: tried to allocate " +
                          format_bytes(requested) + " (" + state + "). " + advice;
  throw OutOfTierMemory(msg, tier_, requested, backing_exhausted, std::move(state), std::move(advice));
}

void TierAllocator::release_cached(std::multimap<size_t, RawBlock>::iterator it) noexcept {
  backing_->release(it->second);
  stats_.reserved_bytes -= as_i64(it->first);
  stats_.released_bytes_total += as_i64(it->first);
  stats_.num_segment_frees++;
  stats_.segments--;
  cached_.erase(it);
}

void TierAllocator::release_all_cached() noexcept {
  while (!cached_.empty()) release_cached(cached_.begin());
}

void TierAllocator::grow(int64_t allocated, int64_t requested, int64_t reserved) noexcept {
  stats_.allocated_bytes += allocated;
  stats_.requested_bytes += requested;
  stats_.reserved_bytes += reserved;
  stats_.active_allocations++;
  stats_.allocated_bytes_total += allocated;
  stats_.requested_bytes_total += requested;
  if (reserved > 0) {
    stats_.reserved_bytes_total += reserved;
    stats_.num_segment_allocs++;
    stats_.segments++;
    stats_.peak_segments = std::max(stats_.peak_segments, stats_.segments);
  }
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_bytes);
  stats_.peak_active_allocations = std::max(stats_.peak_active_allocations, stats_.active_allocations);
}

// ---- queries and maintenance ----

bool TierAllocator::owns(const void* ptr) const noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.count(const_cast<void*>(ptr)) != 0;
}

size_t TierAllocator::block_size(const void* ptr) const noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(const_cast<void*>(ptr));
  return it == live_.end() ? 0 : it->second.raw.bytes;
}

TierStats TierAllocator::stats() const noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

size_t TierAllocator::empty_cache() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t before = stats_.reserved_bytes;
  release_all_cached();
  return static_cast<size_t>(before - stats_.reserved_bytes);
}

void TierAllocator::reset_peak() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  stats_.peak_requested_bytes = stats_.requested_bytes;
  stats_.peak_active_allocations = stats_.active_allocations;
  stats_.peak_segments = stats_.segments;
}

void TierAllocator::reset_accumulated() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.num_allocs = 0;
  stats_.num_frees = 0;
  stats_.num_cache_hits = 0;
  stats_.num_ooms = 0;
  stats_.allocated_bytes_total = stats_.freed_bytes_total = 0;
  stats_.requested_bytes_total = stats_.requested_freed_total = 0;
  stats_.reserved_bytes_total = stats_.released_bytes_total = 0;
  stats_.num_segment_allocs = stats_.num_segment_frees = 0;
}

void TierAllocator::set_capacity(size_t capacity_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t capacity = as_i64(std::min(capacity_bytes, kMaxRequest));
  if (capacity != 0 && capacity < stats_.allocated_bytes) {
    throw std::invalid_argument(std::string("superchip: set_capacity: capacity ") +
                                format_bytes(capacity_bytes) + " for tier '" + tier_name(tier_) +
                                "' is below the " + format_bytes(size_t(stats_.allocated_bytes)) +
                                " allocated in it; free tensors first");
  }
  if (capacity != 0) {
    while (stats_.reserved_bytes > capacity) release_cached(std::prev(cached_.end()));
  }
  stats_.capacity_bytes = capacity;
}

// ---- debug walker ----

void TierAllocator::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const TierStats& s = stats_;
  auto fail = [&](const std::string& what) {
    throw std::logic_error(std::string("superchip: invariant violated in tier '") +
                           tier_name(tier_) + "': " + what);
  };
  auto expect_eq = [&](const char* name, int64_t actual, const char* equation, int64_t expected) {
    if (actual != expected) {
      fail(std::string(name) + " = " + equation + " (" + std::to_string(actual) +
           " != " + std::to_string(expected) + ")");
    }
  };

  int64_t live_bytes = 0;
  int64_t live_requested = 0;
  for (const auto& [ptr, block] : live_) {
    const size_t size = block.raw.bytes;
    if (ptr != block.raw.ptr) fail("live block keyed by its own address");
    if (reinterpret_cast<uintptr_t>(ptr) % kBlockAlignment != 0) fail("blocks are 64-byte aligned");
    if (block.requested == 0) fail("live blocks have a request > 0");
    const size_t rounded = round_size(block.requested);
    if (!(rounded <= size && size <= max_reusable_size(rounded))) {
      fail("round_size(request) <= block size <= round_size(request) * 5/4 (request " +
           std::to_string(block.requested) + ", block " + std::to_string(size) + ")");
    }
    live_bytes += as_i64(size);
    live_requested += as_i64(block.requested);
  }
  int64_t cached_bytes = 0;
  std::unordered_set<const void*> cached_ptrs;
  for (const auto& [size, raw] : cached_) {
    if (size != raw.bytes) fail("cached blocks are keyed by their size");
    if (raw.ptr == nullptr) fail("cached blocks are non-null");
    if (round_size(size) != size) fail("cached block sizes are rounded sizes");
    if (!cached_ptrs.insert(raw.ptr).second) fail("no block is cached twice");
    if (live_.count(raw.ptr) != 0) fail("live and cached blocks are disjoint");
    cached_bytes += as_i64(size);
  }

  expect_eq("allocated_bytes", s.allocated_bytes, "sum(live sizes) + external_bytes",
            live_bytes + s.external_bytes);
  expect_eq("requested_bytes", s.requested_bytes, "sum(live requests) + external_bytes",
            live_requested + s.external_bytes);
  expect_eq("reserved_bytes", s.reserved_bytes,
            "sum(live sizes) + sum(cached sizes) + external_bytes",
            live_bytes + cached_bytes + s.external_bytes);
  expect_eq("active_allocations", s.active_allocations, "|live| + external accounts",
            as_i64(live_.size()) + external_accounts_);
  expect_eq("segments", s.segments, "|live| + |cached| + external accounts",
            as_i64(live_.size() + cached_.size()) + external_accounts_);
  if (s.capacity_bytes != 0 && s.reserved_bytes > s.capacity_bytes) {
    fail("reserved_bytes <= capacity_bytes (" + std::to_string(s.reserved_bytes) + " > " +
         std::to_string(s.capacity_bytes) + ")");
  }
  if (s.peak_allocated_bytes < s.allocated_bytes) fail("peak_allocated_bytes >= allocated_bytes");
  if (s.peak_reserved_bytes < s.reserved_bytes) fail("peak_reserved_bytes >= reserved_bytes");
  if (s.peak_requested_bytes < s.requested_bytes) fail("peak_requested_bytes >= requested_bytes");
  if (s.peak_active_allocations < s.active_allocations) {
    fail("peak_active_allocations >= active_allocations");
  }
  if (s.external_bytes < 0 || external_accounts_ < 0) fail("external_bytes, accounts >= 0");
  if (s.num_allocs < 0 || s.num_frees < 0 || s.num_cache_hits < 0 || s.num_ooms < 0 ||
      s.num_cache_hits > s.num_allocs) {
    fail("counters >= 0 and num_cache_hits <= num_allocs");
  }
}

std::vector<const void*> TierAllocator::block_pointers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const void*> out;
  out.reserve(live_.size() + cached_.size());
  for (const auto& entry : live_) out.push_back(entry.first);
  for (const auto& entry : cached_) out.push_back(entry.second.ptr);
  return out;
}

}  // namespace superchip
