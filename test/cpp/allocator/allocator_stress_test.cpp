// Seeded random alloc/free against a shadow model of the documented policy (rounding, best
// fit with bounded waste, largest-first release under the budget), checked after every step;
// and concurrent alloc/free from several threads. Nothing here is timed.
#include <gtest/gtest.h>

#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "allocator/MemoryManager.h"

namespace superchip {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// Note [Size rounding and reuse] in TierAllocator.h, written out independently.
size_t round_size_ref(size_t n) {
  const size_t g = n < kMiB ? 512 : 128 * kKiB;
  return (n + g - 1) / g * g;
}

// What one tier should do and report, per the header's contract.
struct TierModelRef {
  TierStats stats;
  std::unordered_map<void*, std::pair<size_t, size_t>> live;  // ptr -> (block size, request)
  std::multiset<size_t> cached;
  int64_t external_accounts = 0;

  void grow(int64_t allocated, int64_t requested, int64_t reserved) {
    stats.allocated_bytes += allocated;
    stats.requested_bytes += requested;
    stats.reserved_bytes += reserved;
    stats.active_allocations++;
    stats.num_allocs++;
    stats.allocated_bytes_total += allocated;
    stats.requested_bytes_total += requested;
    if (reserved > 0) {
      stats.reserved_bytes_total += reserved;
      stats.num_segment_allocs++;
      stats.segments++;
      stats.peak_segments = std::max(stats.peak_segments, stats.segments);
    }
    stats.peak_allocated_bytes = std::max(stats.peak_allocated_bytes, stats.allocated_bytes);
    stats.peak_reserved_bytes = std::max(stats.peak_reserved_bytes, stats.reserved_bytes);
    stats.peak_requested_bytes = std::max(stats.peak_requested_bytes, stats.requested_bytes);
    stats.peak_active_allocations = std::max(stats.peak_active_allocations, stats.active_allocations);
  }
  // Predicts a miss of `bytes`: false = OutOfTierMemory; true = fits after dropping the
  // largest cached blocks, which this does.
  bool make_room(size_t bytes) {
    const int64_t cap = stats.capacity_bytes;
    if (cap == 0) return true;
    if (stats.allocated_bytes + int64_t(bytes) > cap) return false;
    while (stats.reserved_bytes + int64_t(bytes) > cap) release(std::prev(cached.end()));
    return true;
  }
  void release(std::multiset<size_t>::iterator block) {
    stats.reserved_bytes -= int64_t(*block);
    stats.released_bytes_total += int64_t(*block);
    stats.num_segment_frees++;
    stats.segments--;
    cached.erase(block);
  }
  // Size of the cached block a request would reuse, 0 for a miss.
  size_t cache_pick(size_t rounded) const {
    auto it = cached.lower_bound(rounded);
    return it != cached.end() && *it <= rounded + rounded / 4 ? *it : 0;
  }
  void release_largest_until(int64_t target) {
    while (stats.reserved_bytes > target) release(std::prev(cached.end()));
  }
};

void expect_stats_eq(const TierStats& got, const TierStats& want, const char* tier, int step) {
  SCOPED_TRACE(std::string("tier ") + tier + ", step " + std::to_string(step));
  EXPECT_EQ(got.allocated_bytes, want.allocated_bytes);
  EXPECT_EQ(got.requested_bytes, want.requested_bytes);
  EXPECT_EQ(got.reserved_bytes, want.reserved_bytes);
  EXPECT_EQ(got.peak_allocated_bytes, want.peak_allocated_bytes);
  EXPECT_EQ(got.peak_reserved_bytes, want.peak_reserved_bytes);
  EXPECT_EQ(got.peak_requested_bytes, want.peak_requested_bytes);
  EXPECT_EQ(got.peak_active_allocations, want.peak_active_allocations);
  EXPECT_EQ(got.capacity_bytes, want.capacity_bytes);
  EXPECT_EQ(got.external_bytes, want.external_bytes);
  EXPECT_EQ(got.active_allocations, want.active_allocations);
  EXPECT_EQ(got.num_allocs, want.num_allocs);
  EXPECT_EQ(got.num_frees, want.num_frees);
  EXPECT_EQ(got.num_cache_hits, want.num_cache_hits);
  EXPECT_EQ(got.num_ooms, want.num_ooms);
  EXPECT_EQ(got.allocated_bytes_total, want.allocated_bytes_total);
  EXPECT_EQ(got.freed_bytes_total, want.freed_bytes_total);
  EXPECT_EQ(got.requested_bytes_total, want.requested_bytes_total);
  EXPECT_EQ(got.requested_freed_total, want.requested_freed_total);
  EXPECT_EQ(got.reserved_bytes_total, want.reserved_bytes_total);
  EXPECT_EQ(got.released_bytes_total, want.released_bytes_total);
  EXPECT_EQ(got.num_segment_allocs, want.num_segment_allocs);
  EXPECT_EQ(got.num_segment_frees, want.num_segment_frees);
  EXPECT_EQ(got.segments, want.segments);
  EXPECT_EQ(got.peak_segments, want.peak_segments);
}

// Stamps the first and last 8 bytes of a block, so that overlapping blocks or a block
// smaller than block_size() show up when the stamp is checked at free time.
void stamp(void* p, size_t size, uint64_t value) {
  std::memcpy(p, &value, 8);
  std::memcpy(static_cast<char*>(p) + size - 8, &value, 8);
}
bool stamp_intact(const void* p, size_t size, uint64_t value) {
  uint64_t head = 0, tail = 0;
  std::memcpy(&head, p, 8);
  std::memcpy(&tail, static_cast<const char*>(p) + size - 8, 8);
  return head == value && tail == value;
}

size_t random_size(std::mt19937_64& rng) {
  const int bucket = int(rng() % 100);
  if (bucket < 3) return 0;
  if (bucket < 15) return 1 + rng() % 1024;
  if (bucket < 60) return 1 + rng() % (64 * kKiB);
  if (bucket < 85) return 1 + rng() % kMiB;
  return kMiB + rng() % (3 * kMiB);
}

class AllocatorStress : public ::testing::TestWithParam<uint64_t> {};

TEST_P(AllocatorStress, MatchesShadowModelAfterEveryStep) {
  const uint64_t seed = GetParam();
  std::mt19937_64 rng(seed);
  MemoryConfig config;
  config.hbm_capacity = 12 * kMiB;
  config.host_capacity = 20 * kMiB;
  MemoryManager mm(config);
  TierModelRef model[kNumTiers];
  model[0].stats.capacity_bytes = int64_t(config.hbm_capacity);
  model[1].stats.capacity_bytes = int64_t(config.host_capacity);
  std::unordered_map<void*, uint64_t> stamps;
  std::vector<void*> live;  // both tiers, for picking a random block to free
  std::vector<std::pair<Tier, size_t>> externals;
  int ooms = 0, hits = 0;

  constexpr int kSteps = 4000;
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", step " + std::to_string(step));
    const Tier tier = rng() % 2 == 0 ? Tier::kHbm : Tier::kHost;
    TierModelRef& m = model[int(tier)];
    const int op = int(rng() % 100);
    const int alloc_share = live.size() < 32 ? 60 : 40;

    if (op < alloc_share) {
      const size_t n = random_size(rng);
      if (n == 0) {
        EXPECT_EQ(mm.allocate(0, tier), nullptr);
      } else {
        const size_t r = round_size_ref(n);
        size_t expect_size = m.cache_pick(r);
        bool expect_ok = true;
        if (expect_size != 0) {
          m.cached.erase(m.cached.find(expect_size));
          m.grow(int64_t(expect_size), int64_t(n), 0);
          m.stats.num_cache_hits++;
          hits++;
        } else if (m.make_room(r)) {
          expect_size = r;
          m.grow(int64_t(r), int64_t(n), int64_t(r));
        } else {
          expect_ok = false;
          m.stats.num_ooms++;
        }
        void* p = nullptr;
        try {
          p = mm.allocate(n, tier);
          EXPECT_TRUE(expect_ok) << "allocate(" << n << ") should have run out of memory";
        } catch (const OutOfTierMemory& e) {
          EXPECT_FALSE(expect_ok) << "unexpected: " << e.what();
          EXPECT_EQ(e.tier(), tier);
          EXPECT_EQ(e.requested(), n);
          ooms++;
        }
        if (p != nullptr) {
          ASSERT_EQ(mm.block_size(p), expect_size);
          ASSERT_EQ(mm.tier_of(p), tier);
          ASSERT_EQ(m.live.count(p), 0u) << "a live pointer was handed out twice";
          m.live[p] = {expect_size, n};
          const uint64_t value = rng();
          stamp(p, expect_size, value);
          stamps[p] = value;
          live.push_back(p);
        }
      }
    } else if (op < 85) {
      if (!live.empty()) {
        const size_t i = rng() % live.size();
        void* p = live[i];
        live[i] = live.back();
        live.pop_back();
        const Tier owner = *mm.tier_of(p);
        TierModelRef& o = model[int(owner)];
        const auto [size, request] = o.live.at(p);
        ASSERT_TRUE(stamp_intact(p, size, stamps.at(p))) << "block " << p << " was overwritten";
        mm.free(p);
        o.live.erase(p);
        o.cached.insert(size);
        o.stats.allocated_bytes -= int64_t(size);
        o.stats.requested_bytes -= int64_t(request);
        o.stats.active_allocations--;
        o.stats.num_frees++;
        o.stats.freed_bytes_total += int64_t(size);
        o.stats.requested_freed_total += int64_t(request);
      }
    } else if (op < 90) {
      if (!externals.empty() && rng() % 2 == 0) {
        const auto [t, n] = externals.back();
        externals.pop_back();
        mm.release_external(t, n);
        TierModelRef& o = model[int(t)];
        o.stats.allocated_bytes -= int64_t(n);
        o.stats.requested_bytes -= int64_t(n);
        o.stats.reserved_bytes -= int64_t(n);
        o.stats.external_bytes -= int64_t(n);
        o.stats.active_allocations--;
        o.stats.num_frees++;
        o.stats.freed_bytes_total += int64_t(n);
        o.stats.requested_freed_total += int64_t(n);
        o.stats.released_bytes_total += int64_t(n);
        o.stats.num_segment_frees++;
        o.stats.segments--;
        o.external_accounts--;
      } else {
        const size_t n = 1 + rng() % (2 * kMiB);
        const bool expect_ok = m.make_room(n);
        if (expect_ok) {
          m.grow(int64_t(n), int64_t(n), int64_t(n));
          m.stats.external_bytes += int64_t(n);
          m.external_accounts++;
          externals.emplace_back(tier, n);
          EXPECT_NO_THROW(mm.account_external(tier, n));
        } else {
          m.stats.num_ooms++;
          EXPECT_THROW(mm.account_external(tier, n), OutOfTierMemory);
        }
      }
    } else if (op < 94) {
      // A new budget: sometimes unlimited, sometimes below what is in use.
      const size_t cap = rng() % 8 == 0 ? 0 : 4 * kMiB + rng() % (24 * kMiB);
      if (cap != 0 && int64_t(cap) < m.stats.allocated_bytes) {
        EXPECT_THROW(mm.set_capacity(tier, cap), std::invalid_argument);
      } else {
        mm.set_capacity(tier, cap);
        if (cap != 0) m.release_largest_until(int64_t(cap));
        m.stats.capacity_bytes = int64_t(cap);
      }
    } else if (op < 96) {
      mm.empty_cache();
      for (TierModelRef& o : model) {
        while (!o.cached.empty()) o.release(o.cached.begin());
        EXPECT_EQ(o.stats.reserved_bytes, o.stats.allocated_bytes);
      }
    } else if (op < 98) {
      mm.reset_peak();
      for (TierModelRef& o : model) {
        o.stats.peak_allocated_bytes = o.stats.allocated_bytes;
        o.stats.peak_reserved_bytes = o.stats.reserved_bytes;
        o.stats.peak_requested_bytes = o.stats.requested_bytes;
        o.stats.peak_active_allocations = o.stats.active_allocations;
        o.stats.peak_segments = o.stats.segments;
      }
    } else {
      mm.reset_accumulated();
      for (TierModelRef& o : model) {
        o.stats.num_allocs = o.stats.num_frees = o.stats.num_cache_hits = o.stats.num_ooms = 0;
        o.stats.allocated_bytes_total = o.stats.freed_bytes_total = 0;
        o.stats.requested_bytes_total = o.stats.requested_freed_total = 0;
        o.stats.reserved_bytes_total = o.stats.released_bytes_total = 0;
        o.stats.num_segment_allocs = o.stats.num_segment_frees = 0;
      }
    }

    ASSERT_NO_THROW(mm.check_invariants());
    expect_stats_eq(mm.stats(Tier::kHbm), model[0].stats, "hbm", step);
    expect_stats_eq(mm.stats(Tier::kHost), model[1].stats, "host", step);
    if (HasFailure()) return;  // the first divergence is the informative one
  }
  // The run must actually have exercised both the cache and the budget.
  EXPECT_GT(hits, 100);
  EXPECT_GT(ooms, 10);

  for (void* p : live) mm.free(p);
  for (const auto& [t, n] : externals) mm.release_external(t, n);
  for (Tier tier : {Tier::kHbm, Tier::kHost}) {
    const TierStats s = mm.stats(tier);
    EXPECT_EQ(s.allocated_bytes, 0);
    EXPECT_EQ(s.requested_bytes, 0);
    EXPECT_EQ(s.active_allocations, 0);
  }
  mm.empty_cache();
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, 0);
  EXPECT_EQ(mm.stats(Tier::kHost).reserved_bytes, 0);
  mm.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Seeds, AllocatorStress, ::testing::Values(1u, 2u, 20240501u));

TEST(AllocatorThreads, ConcurrentAllocFreeReturnsToZero) {
  MemoryManager mm(MemoryConfig{});
  constexpr int kThreads = 4;
  constexpr int kSteps = 3000;
  std::vector<int64_t> allocs(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&mm, &allocs, t] {
      std::mt19937_64 rng(1000 + uint64_t(t));
      std::vector<std::pair<void*, uint64_t>> mine;
      for (int step = 0; step < kSteps; ++step) {
        if (mine.empty() || rng() % 100 < 55) {
          const size_t n = 8 + rng() % (rng() % 8 == 0 ? 3 * kMiB : 32 * kKiB);
          void* p = mm.allocate(n, rng() % 2 == 0 ? Tier::kHbm : Tier::kHost);
          const uint64_t value = rng();
          stamp(p, mm.block_size(p), value);
          mine.emplace_back(p, value);
          allocs[size_t(t)]++;
        } else {
          const size_t i = rng() % mine.size();
          const auto [p, value] = mine[i];
          mine[i] = mine.back();
          mine.pop_back();
          EXPECT_TRUE(stamp_intact(p, mm.block_size(p), value));
          mm.free(p);
        }
        if (step % 500 == 0) (void)mm.stats(Tier::kHbm);
      }
      for (const auto& [p, value] : mine) {
        EXPECT_TRUE(stamp_intact(p, mm.block_size(p), value));
        mm.free(p);
      }
    });
  }
  for (auto& thread : threads) thread.join();

  int64_t total = 0;
  for (int64_t a : allocs) total += a;
  int64_t counted = 0;
  for (Tier tier : {Tier::kHbm, Tier::kHost}) {
    const TierStats s = mm.stats(tier);
    EXPECT_EQ(s.allocated_bytes, 0);
    EXPECT_EQ(s.requested_bytes, 0);
    EXPECT_EQ(s.active_allocations, 0);
    EXPECT_EQ(s.num_allocs, s.num_frees);
    counted += s.num_allocs;
  }
  EXPECT_EQ(counted, total);
  mm.check_invariants();
  mm.empty_cache();
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, 0);
  EXPECT_EQ(mm.stats(Tier::kHost).reserved_bytes, 0);
}

}  // namespace
}  // namespace superchip
