// Unit tests of MemoryManager / TierAllocator in emulated mode (both tiers are host memory).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <numeric>
#include <string>
#include <vector>

#include "allocator/MemoryManager.h"
#include "allocator/TierAllocator.h"
#include "allocator/Topology.h"

#ifdef SUPERCHIP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace superchip {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

MemoryConfig emulated(size_t hbm_capacity = 0, size_t host_capacity = 0) {
  MemoryConfig config;
  config.hbm_capacity = hbm_capacity;
  config.host_capacity = host_capacity;
  return config;
}

void expect_idle(const TierStats& s) {
  EXPECT_EQ(s.allocated_bytes, 0);
  EXPECT_EQ(s.requested_bytes, 0);
  EXPECT_EQ(s.external_bytes, 0);
  EXPECT_EQ(s.active_allocations, 0);
}

// Every field, so that "state unchanged" means unchanged.
void expect_same_stats(const TierStats& a, const TierStats& b) {
  EXPECT_EQ(a.allocated_bytes, b.allocated_bytes);
  EXPECT_EQ(a.requested_bytes, b.requested_bytes);
  EXPECT_EQ(a.reserved_bytes, b.reserved_bytes);
  EXPECT_EQ(a.peak_allocated_bytes, b.peak_allocated_bytes);
  EXPECT_EQ(a.peak_reserved_bytes, b.peak_reserved_bytes);
  EXPECT_EQ(a.capacity_bytes, b.capacity_bytes);
  EXPECT_EQ(a.external_bytes, b.external_bytes);
  EXPECT_EQ(a.active_allocations, b.active_allocations);
  EXPECT_EQ(a.num_allocs, b.num_allocs);
  EXPECT_EQ(a.num_frees, b.num_frees);
  EXPECT_EQ(a.num_cache_hits, b.num_cache_hits);
  EXPECT_EQ(a.num_ooms, b.num_ooms);
}

// ---- names ----

TEST(MemoryNames, TierNamesRoundTrip) {
  EXPECT_STREQ(tier_name(Tier::kHbm), "hbm");
  EXPECT_STREQ(tier_name(Tier::kHost), "host");
  EXPECT_EQ(parse_tier("hbm"), Tier::kHbm);
  EXPECT_EQ(parse_tier("host"), Tier::kHost);
  EXPECT_EQ(parse_tier("HBM"), std::nullopt);
  EXPECT_EQ(parse_tier(""), std::nullopt);
}

TEST(MemoryNames, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3 * kMiB), "3.00 MiB");
  EXPECT_EQ(format_bytes(size_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(format_bytes(size_t{1} << 40), "1.00 TiB");
}

// ---- sizes ----

TEST(MemoryManager, ZeroSizeReturnsNullAndChangesNothing) {
  MemoryManager mm(emulated());
  for (Tier tier : {Tier::kHbm, Tier::kHost}) {
    const TierStats before = mm.stats(tier);
    EXPECT_EQ(mm.allocate(0, tier), nullptr);
    expect_same_stats(mm.stats(tier), before);
    mm.account_external(tier, 0);
    mm.release_external(tier, 0);
    expect_same_stats(mm.stats(tier), before);
  }
  mm.free(nullptr);
  mm.check_invariants();
}

TEST(MemoryManager, RoundingFollowsTheDocumentedEquation) {
  const std::vector<std::pair<size_t, size_t>> cases = {
      {1, 512},
      {511, 512},
      {512, 512},
      {513, 1024},
      {kMiB - 1, kMiB},
      {kMiB, kMiB},
      {kMiB + 1, kMiB + 128 * kKiB},
      {3 * kMiB + 5, 3 * kMiB + 128 * kKiB},
  };
  MemoryManager mm(emulated());
  for (const auto& [request, expected] : cases) {
    EXPECT_EQ(TierAllocator::round_size(request), expected) << "request " << request;
    EXPECT_EQ(TierAllocator::round_size(expected), expected) << "idempotent at " << expected;
    void* p = mm.allocate(request, Tier::kHbm);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    EXPECT_EQ(mm.block_size(p), expected);
    EXPECT_EQ(mm.stats(Tier::kHbm).allocated_bytes, int64_t(expected));
    EXPECT_EQ(mm.stats(Tier::kHbm).requested_bytes, int64_t(request));
    std::memset(p, 0xab, mm.block_size(p));  // the whole block is usable
    mm.free(p);
    mm.empty_cache();
  }
  mm.check_invariants();
}

// ---- caching ----

TEST(MemoryManager, FreedBlockIsReusedAndCountedAsCacheHit) {
  MemoryManager mm(emulated());
  void* a = mm.allocate(1000, Tier::kHbm);
  mm.free(a);
  EXPECT_EQ(mm.stats(Tier::kHbm).num_cache_hits, 0);
  void* b = mm.allocate(900, Tier::kHbm);  // same rounded size: 1024
  EXPECT_EQ(b, a);
  const TierStats s = mm.stats(Tier::kHbm);
  EXPECT_EQ(s.num_cache_hits, 1);
  EXPECT_EQ(s.num_allocs, 2);
  EXPECT_EQ(s.reserved_bytes, 1024);
  EXPECT_EQ(s.requested_bytes, 900);
  mm.free(b);
  mm.check_invariants();
}

TEST(MemoryManager, CacheIsBestFitWithBoundedWaste) {
  MemoryManager mm(emulated());
  void* big = mm.allocate(4096, Tier::kHost);
  void* mid = mm.allocate(2560, Tier::kHost);
  mm.free(big);
  mm.free(mid);
  // 2048 rounds to 2048; cached 2560 <= 2048 + 512 fits, 4096 would too but is worse.
  void* p = mm.allocate(2048, Tier::kHost);
  EXPECT_EQ(p, mid);
  EXPECT_EQ(mm.block_size(p), 2560u);
  EXPECT_EQ(mm.stats(Tier::kHost).allocated_bytes, 2560);
  // 512 may not pin down the cached 4096 block (4096 > 512 + 128): a new block is made.
  void* q = mm.allocate(512, Tier::kHost);
  EXPECT_NE(q, big);
  EXPECT_EQ(mm.block_size(q), 512u);
  EXPECT_EQ(mm.stats(Tier::kHost).num_cache_hits, 1);
  EXPECT_EQ(mm.stats(Tier::kHost).reserved_bytes, 4096 + 2560 + 512);
  mm.free(p);
  mm.free(q);
  mm.check_invariants();
}

TEST(MemoryManager, StatsReturnToZeroAfterFrees) {
  MemoryManager mm(emulated());
  std::vector<void*> blocks;
  for (size_t i = 1; i <= 40; ++i) {
    blocks.push_back(mm.allocate(i * 37 * kKiB, i % 2 == 0 ? Tier::kHbm : Tier::kHost));
  }
  mm.check_invariants();
  EXPECT_EQ(mm.stats(Tier::kHbm).active_allocations, 20);
  EXPECT_EQ(mm.stats(Tier::kHost).active_allocations, 20);
  for (void* p : blocks) mm.free(p);
  for (Tier tier : {Tier::kHbm, Tier::kHost}) {
    const TierStats s = mm.stats(tier);
    expect_idle(s);
    EXPECT_EQ(s.num_allocs, 20);
    EXPECT_EQ(s.num_frees, 20);
    EXPECT_GT(s.reserved_bytes, 0);  // cached until empty_cache
  }
  mm.check_invariants();
}

TEST(MemoryManager, EmptyCacheDropsReservedToAllocated) {
  MemoryManager mm(emulated());
  void* keep = mm.allocate(3 * kMiB, Tier::kHbm);
  void* drop = mm.allocate(5 * kMiB, Tier::kHbm);
  void* host = mm.allocate(100, Tier::kHost);
  mm.free(drop);
  mm.free(host);
  mm.account_external(Tier::kHbm, 1000);
  EXPECT_GT(mm.stats(Tier::kHbm).reserved_bytes, mm.stats(Tier::kHbm).allocated_bytes);
  mm.empty_cache();
  for (Tier tier : {Tier::kHbm, Tier::kHost}) {
    EXPECT_EQ(mm.stats(tier).reserved_bytes, mm.stats(tier).allocated_bytes);
  }
  EXPECT_EQ(mm.stats(Tier::kHbm).allocated_bytes, int64_t(3 * kMiB + 1000));
  EXPECT_EQ(mm.stats(Tier::kHost).reserved_bytes, 0);
  mm.free(keep);
  mm.release_external(Tier::kHbm, 1000);
  mm.empty_cache();
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, 0);
  mm.check_invariants();
}

TEST(MemoryManager, EmptyCacheOfOneTierLeavesTheOtherAndSaysWhatItGaveBack) {
  MemoryManager mm(emulated());
  void* hbm = mm.allocate(5 * kMiB, Tier::kHbm);
  void* host = mm.allocate(3 * kMiB, Tier::kHost);
  mm.free(hbm);
  mm.free(host);
  const int64_t hbm_cached = mm.stats(Tier::kHbm).reserved_bytes;
  const int64_t host_cached = mm.stats(Tier::kHost).reserved_bytes;
  ASSERT_GE(hbm_cached, int64_t(5 * kMiB));
  EXPECT_EQ(mm.empty_cache(Tier::kHbm), size_t(hbm_cached));
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, 0);
  EXPECT_EQ(mm.stats(Tier::kHost).reserved_bytes, host_cached);
  EXPECT_EQ(mm.empty_cache(Tier::kHbm), 0u);
  EXPECT_EQ(mm.empty_cache(Tier::kHost), size_t(host_cached));
  mm.check_invariants();
}

// ---- another allocator's cache (Backing::release_foreign) ----

// Host memory that is "full" while another allocator holds its cache; release_foreign() makes
// that allocator give it back, and checks from another thread that the tier's mutex is free
// meanwhile (CUDA's allocator takes its own locks and may take the GIL there).
class ForeignCacheBacking final : public Backing {
 public:
  bool foreign_holds = true;
  bool foreign_gives_back = true;
  int releases = 0;
  bool tier_unlocked_during_release = false;
  TierAllocator* tier = nullptr;

  RawBlock allocate(size_t bytes) override {
    if (foreign_holds) return {};
    RawBlock b;
    b.ptr = std::aligned_alloc(kBlockAlignment, bytes);
    b.bytes = bytes;
    return b;
  }
  void release(const RawBlock& block) noexcept override { std::free(block.ptr); }
  const char* name() const noexcept override { return "the fake device"; }
  bool release_foreign() noexcept override {
    releases++;
    auto other = std::async(std::launch::async, [this] { (void)tier->stats(); });
    tier_unlocked_during_release = other.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    if (foreign_gives_back) foreign_holds = false;
    return true;
  }
};

TEST(TierAllocator, AsksTheOtherAllocatorOnceOutsideItsLockWhenTheMemoryIsFull) {
  auto owned = std::make_unique<ForeignCacheBacking>();
  ForeignCacheBacking* backing = owned.get();
  TierAllocator tier(Tier::kHbm, 0, 0, std::move(owned));
  backing->tier = &tier;
  void* p = tier.allocate(kMiB);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(backing->releases, 1);
  EXPECT_TRUE(backing->tier_unlocked_during_release);
  EXPECT_EQ(tier.stats().allocated_bytes, int64_t(kMiB));
  EXPECT_EQ(tier.stats().num_ooms, 0);
  tier.free(p);
}

TEST(TierAllocator, FailsNamingTheMemoryWhenTheOtherAllocatorHasNothingToGive) {
  auto owned = std::make_unique<ForeignCacheBacking>();
  ForeignCacheBacking* backing = owned.get();
  backing->foreign_gives_back = false;
  TierAllocator tier(Tier::kHbm, 0, 0, std::move(owned));
  backing->tier = &tier;
  EXPECT_EQ(tier.try_allocate(kMiB), nullptr);
  EXPECT_EQ(backing->releases, 1);
  EXPECT_EQ(tier.stats().num_ooms, 0);  // quiet: a caller with a fallback
  try {
    tier.allocate(kMiB);
    FAIL() << "expected OutOfTierMemory";
  } catch (const OutOfTierMemory& e) {
    EXPECT_NE(std::string(e.what()).find("the fake device has no more free memory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(backing->releases, 2);  // once per request
  EXPECT_TRUE(backing->tier_unlocked_during_release);
  expect_idle(tier.stats());
}

// ---- peaks ----

TEST(MemoryManager, PeakTrackingAndReset) {
  MemoryManager mm(emulated());
  void* a = mm.allocate(2 * kMiB, Tier::kHbm);
  void* b = mm.allocate(3 * kMiB, Tier::kHbm);
  mm.free(a);
  TierStats s = mm.stats(Tier::kHbm);
  EXPECT_EQ(s.allocated_bytes, int64_t(3 * kMiB));
  EXPECT_EQ(s.peak_allocated_bytes, int64_t(5 * kMiB));
  EXPECT_EQ(s.peak_reserved_bytes, int64_t(5 * kMiB));
  mm.reset_peak();
  s = mm.stats(Tier::kHbm);
  EXPECT_EQ(s.peak_allocated_bytes, int64_t(3 * kMiB));
  EXPECT_EQ(s.peak_reserved_bytes, int64_t(5 * kMiB));  // a is still cached
  mm.free(b);
  mm.empty_cache();
  mm.reset_peak();
  s = mm.stats(Tier::kHbm);
  EXPECT_EQ(s.peak_allocated_bytes, 0);
  EXPECT_EQ(s.peak_reserved_bytes, 0);
  mm.reset_accumulated();
  s = mm.stats(Tier::kHbm);
  EXPECT_EQ(s.num_allocs, 0);
  EXPECT_EQ(s.num_frees, 0);
  EXPECT_EQ(s.num_cache_hits, 0);
  EXPECT_EQ(s.num_ooms, 0);
  mm.check_invariants();
}

// ---- budget ----

TEST(MemoryManager, OutOfMemoryMessageAndUnchangedState) {
  MemoryManager mm(emulated(8 * kMiB));
  void* a = mm.allocate(6 * kMiB, Tier::kHbm);
  const TierStats before = mm.stats(Tier::kHbm);
  try {
    mm.allocate(3 * kMiB, Tier::kHbm);
    FAIL() << "expected OutOfTierMemory";
  } catch (const OutOfTierMemory& e) {
    EXPECT_EQ(e.tier(), Tier::kHbm);
    EXPECT_EQ(e.requested(), 3 * kMiB);
    EXPECT_EQ(std::string(e.what()),
              "superchip: out of memory. Tier 'hbm' of superchip:0 cannot take it: tried to allocate 3.00 MiB "
              "(capacity 8.00 MiB, 6.00 MiB allocated by tensors, 0 B cached). Free tensors, call "
              "superchip.empty_cache(), move tensors to the host tier with "
              "superchip.move_to_tier(t, \"host\"), or raise SUPERCHIP_HBM_BYTES.");
  }
  TierStats after = mm.stats(Tier::kHbm);
  EXPECT_EQ(after.num_ooms, 1);
  after.num_ooms = 0;
  expect_same_stats(after, before);
  mm.check_invariants();
  mm.free(a);
}

TEST(MemoryManager, HostOutOfMemoryNamesHostVariable) {
  MemoryConfig config = emulated(0, 4 * kMiB);
  config.device_index = 3;
  MemoryManager mm(config);
  void* a = mm.allocate(2 * kMiB, Tier::kHost);
  void* cached = mm.allocate(1 * kMiB, Tier::kHost);
  mm.free(cached);
  try {
    mm.allocate(3 * kMiB, Tier::kHost);
    FAIL() << "expected OutOfTierMemory";
  } catch (const OutOfTierMemory& e) {
    EXPECT_EQ(e.tier(), Tier::kHost);
    EXPECT_EQ(std::string(e.what()),
              "superchip: out of memory. Tier 'host' of superchip:3 cannot take it: tried to allocate 3.00 MiB "
              "(capacity 4.00 MiB, 2.00 MiB allocated by tensors, 1.00 MiB cached). Free "
              "tensors, call superchip.empty_cache(), or raise SUPERCHIP_HOST_BYTES.");
  }
  // The failed request did not drop the cache: the cached block is still reused.
  EXPECT_EQ(mm.allocate(kMiB, Tier::kHost), cached);
  EXPECT_EQ(mm.stats(Tier::kHost).num_cache_hits, 1);
  mm.free(a);
  mm.free(cached);
  mm.check_invariants();
}

TEST(MemoryManager, MissReleasesCacheToFitBudget) {
  MemoryManager mm(emulated(8 * kMiB));
  void* a = mm.allocate(4 * kMiB, Tier::kHbm);
  void* b = mm.allocate(2 * kMiB, Tier::kHbm);
  void* c = mm.allocate(kKiB, Tier::kHbm);
  mm.free(a);
  mm.free(c);
  // 5 MiB fits only once the cached 4 MiB block is gone; the small cached block stays.
  void* d = mm.allocate(5 * kMiB, Tier::kHbm);
  const TierStats s = mm.stats(Tier::kHbm);
  EXPECT_EQ(s.allocated_bytes, int64_t(7 * kMiB));
  EXPECT_EQ(s.reserved_bytes, int64_t(7 * kMiB + kKiB));
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_LE(s.peak_reserved_bytes, s.capacity_bytes);
  mm.free(b);
  mm.free(d);
  mm.check_invariants();
}

TEST(MemoryManager, AllocationSucceedsAgainAfterFreeing) {
  MemoryManager mm(emulated(4 * kMiB));
  void* a = mm.allocate(3 * kMiB, Tier::kHbm);
  EXPECT_THROW(mm.allocate(2 * kMiB, Tier::kHbm), OutOfTierMemory);
  mm.free(a);
  void* b = mm.allocate(2 * kMiB, Tier::kHbm);
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, int64_t(2 * kMiB));
  mm.free(b);
  mm.check_invariants();
}

TEST(MemoryManager, ExternalAccounting) {
  MemoryManager mm(emulated(0, 10000));
  mm.account_external(Tier::kHost, 3000);
  mm.account_external(Tier::kHost, 5000);
  TierStats s = mm.stats(Tier::kHost);
  EXPECT_EQ(s.allocated_bytes, 8000);
  EXPECT_EQ(s.requested_bytes, 8000);
  EXPECT_EQ(s.reserved_bytes, 8000);
  EXPECT_EQ(s.external_bytes, 8000);
  EXPECT_EQ(s.active_allocations, 2);
  EXPECT_EQ(s.num_allocs, 2);
  EXPECT_EQ(s.peak_allocated_bytes, 8000);
  EXPECT_THROW(mm.account_external(Tier::kHost, 3000), OutOfTierMemory);
  EXPECT_EQ(mm.stats(Tier::kHost).external_bytes, 8000);
  EXPECT_EQ(mm.stats(Tier::kHost).num_ooms, 1);
  mm.check_invariants();
  mm.release_external(Tier::kHost, 3000);
  mm.release_external(Tier::kHost, 5000);
  s = mm.stats(Tier::kHost);
  expect_idle(s);
  EXPECT_EQ(s.reserved_bytes, 0);
  EXPECT_EQ(s.num_frees, 2);
  EXPECT_EQ(mm.stats(Tier::kHbm).num_allocs, 0);
  // Over-release is reported and clamped, never negative.
  mm.account_external(Tier::kHost, 100);
  mm.release_external(Tier::kHost, 500);
  expect_idle(mm.stats(Tier::kHost));
  mm.check_invariants();
}

TEST(MemoryManager, SetCapacity) {
  MemoryManager mm(emulated());
  void* a = mm.allocate(2 * kMiB, Tier::kHbm);
  void* b = mm.allocate(3 * kMiB, Tier::kHbm);
  mm.free(b);
  EXPECT_THROW(mm.set_capacity(Tier::kHbm, kMiB), std::invalid_argument);
  EXPECT_EQ(mm.stats(Tier::kHbm).capacity_bytes, 0);
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, int64_t(5 * kMiB));
  // A budget between in-use and reserved drops the cache to fit.
  mm.set_capacity(Tier::kHbm, 4 * kMiB);
  EXPECT_EQ(mm.stats(Tier::kHbm).capacity_bytes, int64_t(4 * kMiB));
  EXPECT_EQ(mm.stats(Tier::kHbm).reserved_bytes, int64_t(2 * kMiB));
  EXPECT_THROW(mm.allocate(3 * kMiB, Tier::kHbm), OutOfTierMemory);
  mm.set_capacity(Tier::kHbm, 0);  // unlimited
  void* c = mm.allocate(3 * kMiB, Tier::kHbm);
  mm.check_invariants();
  mm.free(a);
  mm.free(c);
}

// ---- pointers ----

TEST(MemoryManager, ForeignPointers) {
  MemoryManager mm(emulated());
  int local = 0;
  std::vector<char> heap(4096);
  EXPECT_EQ(mm.tier_of(&local), std::nullopt);
  EXPECT_EQ(mm.tier_of(heap.data()), std::nullopt);
  EXPECT_EQ(mm.tier_of(nullptr), std::nullopt);
  EXPECT_EQ(mm.block_size(&local), 0u);
  EXPECT_EQ(mm.block_size(nullptr), 0u);
  void* h = mm.allocate(100, Tier::kHbm);
  void* p = mm.allocate(100, Tier::kHost);
  EXPECT_EQ(mm.tier_of(h), Tier::kHbm);
  EXPECT_EQ(mm.tier_of(p), Tier::kHost);
  EXPECT_EQ(mm.tier_of(static_cast<char*>(h) + 1), std::nullopt);  // interior: not a block
  mm.free(&local);  // reported to stderr, ignored
  mm.free(h);
  EXPECT_EQ(mm.tier_of(h), std::nullopt);  // cached blocks are not live
  EXPECT_EQ(mm.block_size(h), 0u);
  mm.free(h);  // double free: reported, ignored, counted nowhere
  EXPECT_EQ(mm.stats(Tier::kHbm).num_frees, 1);
  mm.free(p);
  mm.check_invariants();
}

// ---- host tier and copies ----

TEST(MemoryManager, HostTierOnTopologyNumaNode) {
  const Topology& topo = Topology::get();
  MemoryConfig config = emulated();
  config.numa_node = topo.nodes()[size_t(topo.nearest_node(""))].os_index;
  MemoryManager mm(config);
  for (size_t n : {size_t{100}, 64 * kKiB, 2 * kMiB, 9 * kMiB + 3}) {
    auto* p = static_cast<unsigned char*>(mm.allocate(n, Tier::kHost));
    ASSERT_NE(p, nullptr);
    std::memset(p, 0x5a, n);
    EXPECT_EQ(p[0], 0x5a);
    EXPECT_EQ(p[n - 1], 0x5a);
    mm.free(p);
  }
  mm.empty_cache();
  EXPECT_EQ(mm.stats(Tier::kHost).reserved_bytes, 0);
  mm.check_invariants();
}

TEST(MemoryManager, CopyBetweenTiers) {
  MemoryManager mm(emulated());
  for (size_t n : {size_t{1}, size_t{1000}, 3 * kMiB + 7}) {
    std::vector<unsigned char> src(n);
    std::iota(src.begin(), src.end(), static_cast<unsigned char>(n));
    void* hbm = mm.allocate(n, Tier::kHbm);
    void* host = mm.allocate(n, Tier::kHost);
    mm.copy(hbm, src.data(), n);
    mm.copy(host, hbm, n);
    std::vector<unsigned char> back(n);
    mm.copy(back.data(), host, n);
    EXPECT_EQ(back, src) << "n=" << n;
    mm.free(hbm);
    mm.free(host);
  }
  mm.copy(nullptr, nullptr, 0);  // size zero touches nothing
}

TEST(MemoryManager, CudaConfigWithoutUsableCuda) {
  MemoryConfig config = emulated();
  config.cuda = true;
#ifdef SUPERCHIP_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    EXPECT_THROW(MemoryManager mm(config), std::runtime_error);
    return;
  }
  config.device_index = count;  // one past the last device
  EXPECT_THROW(MemoryManager mm(config), std::invalid_argument);
#else
  try {
    MemoryManager mm(config);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA support"), std::string::npos) << e.what();
  }
#endif
}

#ifdef SUPERCHIP_HAVE_CUDA
// Runs only where a GPU is visible: the cudaMalloc'd hbm tier and pinned host blocks.
TEST(MemoryManager, CudaHbmTier) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device visible";
  }
  MemoryConfig config = emulated(64 * kMiB);
  config.cuda = true;
  config.pin_host = true;
  MemoryManager mm(config);
  const size_t n = 3 * kMiB;
  std::vector<unsigned char> src(n, 7), back(n, 0);
  void* d = mm.allocate(n, Tier::kHbm);
  void* h = mm.allocate(n, Tier::kHost);
  mm.copy(d, src.data(), n);
  mm.copy(h, d, n);
  mm.copy(back.data(), h, n);
  EXPECT_EQ(back, src);
  EXPECT_THROW(mm.allocate(128 * kMiB, Tier::kHbm), OutOfTierMemory);
  mm.free(d);
  mm.free(h);
  mm.check_invariants();
}
#endif

// pin_host asks for cudaHostRegister; without a GPU (or CUDA) it must still work, pageable.
TEST(MemoryManager, PinHostWorksWithoutGpu) {
  MemoryConfig config = emulated();
  config.pin_host = true;
  MemoryManager mm(config);
  void* p = mm.allocate(2 * kMiB, Tier::kHost);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, 2 * kMiB);
  mm.free(p);
  mm.empty_cache();
  mm.check_invariants();
}

}  // namespace
}  // namespace superchip

// ---- Note [Placement]: allocate_placed, account_external_placed, weights_limit ----

namespace superchip {
namespace {

TEST(Placement, HbmFirstThenHostCountedAsSpills) {
  MemoryManager m(emulated(4 * kMiB));
  const MemoryManager::Placed a = m.allocate_placed(3 * kMiB);
  EXPECT_EQ(a.tier, Tier::kHbm);
  const MemoryManager::Placed b = m.allocate_placed(2 * kMiB);  // hbm cannot hold it
  EXPECT_EQ(b.tier, Tier::kHost);
  EXPECT_EQ(m.tier_of(b.ptr), Tier::kHost);
  EXPECT_EQ(m.stats(Tier::kHost).num_spills, 1);
  EXPECT_EQ(m.stats(Tier::kHbm).num_ooms, 0);  // a spill is no error
  std::memset(b.ptr, 1, 2 * kMiB);
  m.free(a.ptr);
  m.free(b.ptr);
  m.reset_accumulated();
  EXPECT_EQ(m.stats(Tier::kHost).num_spills, 0);
}

TEST(Placement, LimitKeepsTheReserveButIsOnlyAPreference) {
  MemoryConfig c = emulated(10 * kMiB, 4 * kMiB);
  c.hbm_reserve_fraction = 0.2;
  MemoryManager m(c);
  EXPECT_EQ(m.weights_limit(), 8 * kMiB);
  const MemoryManager::Placed w1 = m.allocate_placed(6 * kMiB, m.weights_limit());
  EXPECT_EQ(w1.tier, Tier::kHbm);
  const MemoryManager::Placed w2 = m.allocate_placed(3 * kMiB, m.weights_limit());
  EXPECT_EQ(w2.tier, Tier::kHost);  // past the limit: host has room
  const MemoryManager::Placed w3 = m.allocate_placed(3 * kMiB, m.weights_limit());
  EXPECT_EQ(w3.tier, Tier::kHbm);   // host full too: hbm past the limit beats failing
  for (void* p : {w1.ptr, w2.ptr, w3.ptr}) m.free(p);
  MemoryConfig bytes = emulated(10 * kMiB);
  bytes.hbm_reserve_bytes = 3 * kMiB;
  EXPECT_EQ(MemoryManager(bytes).weights_limit(), 7 * kMiB);
  EXPECT_EQ(MemoryManager(emulated()).weights_limit(), 0u);  // unlimited hbm: no reserve
}

TEST(Placement, BothTiersFullNamesBothAndChangesNothing) {
  MemoryManager m(emulated(4 * kMiB, 4 * kMiB));
  void* a = m.allocate(3 * kMiB, Tier::kHbm);
  void* b = m.allocate(3 * kMiB, Tier::kHost);
  const TierStats hbm = m.stats(Tier::kHbm), host = m.stats(Tier::kHost);
  try {
    m.allocate_placed(2 * kMiB);
    FAIL() << "no error";
  } catch (const OutOfTierMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Neither tier of superchip:0 can take it: tried to allocate 2.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("hbm: capacity 4.00 MiB, 3.00 MiB allocated by tensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("; host: capacity 4.00 MiB, 3.00 MiB allocated by tensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Free tensors, call superchip.empty_cache(), or raise a budget (superchip.set_capacity("),
              std::string::npos) << msg;
    EXPECT_EQ(msg.find("out of memory"), msg.rfind("out of memory")) << msg;  // one error, not two joined
  }
  try {
    m.allocate_placed(5 * kMiB);  // more than either budget
    FAIL() << "no error";
  } catch (const OutOfTierMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Neither tier's budget could hold it even with nothing else in it"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("empty_cache"), std::string::npos) << msg;
  }
  EXPECT_EQ(m.stats(Tier::kHbm).allocated_bytes, hbm.allocated_bytes);
  EXPECT_EQ(m.stats(Tier::kHost).allocated_bytes, host.allocated_bytes);
  EXPECT_EQ(m.stats(Tier::kHost).num_ooms, host.num_ooms + 2);
  EXPECT_THROW(m.account_external_placed(2 * kMiB), OutOfTierMemory);
  EXPECT_EQ(m.account_external_placed(512 * kKiB), Tier::kHbm);
  EXPECT_EQ(m.account_external_placed(1 * kMiB), Tier::kHost);
  m.release_external(Tier::kHbm, 512 * kKiB);
  m.release_external(Tier::kHost, 1 * kMiB);
  m.free(a);
  m.free(b);
}

TEST(Placement, WithPinnedHostOnlyPinnableBlocksGoToHost) {
  MemoryConfig c = emulated(2 * kMiB);
  c.pin_host = true;  // a GPU's kernels read host blocks: only the pinned (mmap) sizes qualify
  MemoryManager m(c);
  EXPECT_FALSE(m.host_placeable(64 * kKiB));
  EXPECT_TRUE(m.host_placeable(2 * kMiB));
  void* a = m.allocate(2 * kMiB, Tier::kHbm);
  EXPECT_THROW(m.allocate_placed(64 * kKiB), OutOfTierMemory);  // hbm full, too small to pin
  const MemoryManager::Placed big = m.allocate_placed(2 * kMiB);
  EXPECT_EQ(big.tier, Tier::kHost);
  m.free(big.ptr);
  m.free(a);
}

}  // namespace
}  // namespace superchip
