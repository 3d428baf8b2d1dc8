#include "allocator/MemoryManager.h"

#include <atomic>

#include <cstdio>
#include <cstring>
#include <unordered_set>

#include "allocator/Backing.h"
#include "allocator/TierAllocator.h"

namespace superchip {

// ---- names and formatting ----

const char* tier_name(Tier tier) noexcept {
  switch (tier) {
    case Tier::kHbm:
      return "hbm";
    case Tier::kHost:
      return "host";
  }
  return "unknown";
}

std::optional<Tier> parse_tier(std::string_view name) noexcept {
  if (name == "hbm") return Tier::kHbm;
  if (name == "host") return Tier::kHost;
  return std::nullopt;
}

std::string format_bytes(size_t nbytes) {
  if (nbytes < 1024) return std::to_string(nbytes) + " B";
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(nbytes) / 1024.0;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < sizeof(kUnits) / sizeof(kUnits[0])) {
    value /= 1024.0;
    unit++;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  return buf;
}

// ---- MemoryManager ----

// The pointer -> block maps live in the tiers (each under its own mutex), so a lookup asks
// hbm first and then host; a pointer is live in at most one tier.
struct MemoryManager::Impl {
  explicit Impl(const MemoryConfig& cfg)
      : config(cfg),
        hbm(Tier::kHbm, cfg.device_index, cfg.hbm_capacity, make_hbm_backing(cfg)),
        host(Tier::kHost, cfg.device_index, cfg.host_capacity, make_host_backing(cfg)) {}

  TierAllocator& tier(Tier t) { return t == Tier::kHbm ? hbm : host; }
  const TierAllocator& tier(Tier t) const { return t == Tier::kHbm ? hbm : host; }

  const MemoryConfig config;
  TierAllocator hbm;
  TierAllocator host;
  std::atomic<int64_t> spills{0};
};

MemoryManager::MemoryManager(const MemoryConfig& config) : impl_(std::make_unique<Impl>(config)) {}

MemoryManager::~MemoryManager() = default;

void* MemoryManager::allocate(size_t nbytes, Tier tier) { return impl_->tier(tier).allocate(nbytes); }

void* MemoryManager::try_allocate(size_t nbytes, Tier tier) noexcept {
  if (nbytes == 0) return nullptr;
  try {
    return impl_->tier(tier).try_allocate(nbytes);
  } catch (...) {
    return nullptr;
  }
}

// Note [Placement]
// Tensors that may live in either tier (every allocation the superchip allocator makes for
// an operator, a factory or a copy onto the device) go to hbm while it has room, then to host:
// a model larger than hbm loads and runs instead of failing, and only when both tiers are full
// does an allocation fail, with an error naming both. A limit below hbm's capacity keeps a
// reserve of hbm for activations: weights copied in from the CPU are placed under it (the
// backend passes capacity - reserve), so they cannot fill hbm and push every activation out.
// Explicit tier requests (allocate(), superchip.move_to_tier) never fall back.
MemoryManager::Placed MemoryManager::allocate_placed(size_t nbytes, size_t hbm_limit) {
  if (nbytes == 0) return {nullptr, Tier::kHbm};
  const bool under_limit =
      hbm_limit == 0 || impl_->hbm.stats().allocated_bytes + static_cast<int64_t>(nbytes) <=
                            static_cast<int64_t>(hbm_limit);
  if (under_limit) {
    if (void* p = impl_->hbm.try_allocate(nbytes)) return {p, Tier::kHbm};
  }
  if (!host_placeable(nbytes)) return {impl_->hbm.allocate(nbytes), Tier::kHbm};  // may throw
  if (void* p = impl_->host.try_allocate(nbytes)) {
    impl_->spills.fetch_add(1, std::memory_order_relaxed);
    return {p, Tier::kHost};
  }
  if (!under_limit) {
    if (void* p = impl_->hbm.try_allocate(nbytes)) return {p, Tier::kHbm};
  }
  try {
    return {impl_->host.allocate(nbytes), Tier::kHost};  // counts the error, names host
  } catch (const OutOfTierMemory& host_error) {
    throw_both_full(nbytes, host_error);
  }
}

Tier MemoryManager::account_external_placed(size_t nbytes) {
  if (impl_->hbm.try_account_external(nbytes)) return Tier::kHbm;
  if (impl_->host.try_account_external(nbytes)) {
    impl_->spills.fetch_add(1, std::memory_order_relaxed);
    return Tier::kHost;
  }
  try {
    impl_->host.account_external(nbytes);  // counts the error, names host
    return Tier::kHost;
  } catch (const OutOfTierMemory& host_error) {
    throw_both_full(nbytes, host_error);
  }
}

void MemoryManager::throw_both_full(size_t nbytes, const OutOfTierMemory& host_error) const {
  // Each tier's state once, then one piece of advice (it read as two errors joined, the
  // request twice, and budgets only by environment variables: found by review).
  const TierStats h = impl_->hbm.stats();
  const TierStats o = impl_->host.stats();
  const std::string hbm_state =
      "capacity " + (h.capacity_bytes == 0 ? std::string("unlimited") : format_bytes(size_t(h.capacity_bytes))) +
      ", " + format_bytes(size_t(h.allocated_bytes)) + " allocated by tensors, " +
      format_bytes(size_t(h.reserved_bytes - h.allocated_bytes)) + " cached";
  const auto fits = [nbytes](const TierStats& t) { return t.capacity_bytes == 0 || nbytes <= size_t(t.capacity_bytes); };
  const char* budgets =
      "superchip.set_capacity(\"hbm\" or \"host\", nbytes), or SUPERCHIP_HBM_BYTES / SUPERCHIP_HOST_BYTES "
      "before the process starts";
  std::string advice;
  if (host_error.system()) {
    advice = host_error.advice();  // where the machine ran out, a larger budget would not help
  } else if (!fits(h) && !fits(o)) {
    advice = std::string("Neither tier's budget could hold it even with nothing else in it: raise a budget (") +
             budgets + "), or allocate less.";
  } else {
    advice = std::string("Free tensors, call superchip.empty_cache(), or raise a budget (") + budgets + ").";
  }
  // "out of memory.": Note [The words "out of memory."] in TierAllocator.cpp.
  throw OutOfTierMemory("superchip: out of memory. Neither tier of superchip:" +
                            std::to_string(impl_->config.device_index) + " can take it: tried to allocate " +
                            format_bytes(nbytes) + "; hbm: " + hbm_state + "; host: " + host_error.state() +
                            ". " + advice,
                        Tier::kHost, nbytes, host_error.system(), host_error.state(), advice);
}

bool MemoryManager::host_placeable(size_t nbytes) const noexcept {
  return !impl_->config.pin_host || nbytes >= kMmapThreshold;
}

size_t MemoryManager::weights_limit() const noexcept {
  const auto cap = static_cast<size_t>(impl_->hbm.stats().capacity_bytes);
  if (cap == 0) return 0;
  const MemoryConfig& c = impl_->config;
  const size_t reserve = c.hbm_reserve_bytes > 0
                             ? c.hbm_reserve_bytes
                             : static_cast<size_t>(static_cast<double>(cap) * c.hbm_reserve_fraction);
  return reserve < cap ? cap - reserve : 1;  // 1: no weight fits under the limit
}

void MemoryManager::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (impl_->hbm.free(ptr) || impl_->host.free(ptr)) return;
  std::fprintf(stderr, "superchip: free(%p): not a live block of this allocator; ignored\n", ptr);
}

void MemoryManager::account_external(Tier tier, size_t nbytes) {
  impl_->tier(tier).account_external(nbytes);
}

bool MemoryManager::try_account_external(Tier tier, size_t nbytes) {
  return impl_->tier(tier).try_account_external(nbytes);
}

void MemoryManager::release_external(Tier tier, size_t nbytes) noexcept {
  impl_->tier(tier).release_external(nbytes);
}

std::optional<Tier> MemoryManager::tier_of(const void* ptr) const noexcept {
  if (ptr == nullptr) return std::nullopt;
  if (impl_->hbm.owns(ptr)) return Tier::kHbm;
  if (impl_->host.owns(ptr)) return Tier::kHost;
  return std::nullopt;
}

size_t MemoryManager::block_size(const void* ptr) const noexcept {
  if (ptr == nullptr) return 0;
  const size_t size = impl_->hbm.block_size(ptr);
  return size != 0 ? size : impl_->host.block_size(ptr);
}

void MemoryManager::copy(void* dst, const void* src, size_t nbytes) const {
  if (nbytes == 0 || dst == src) return;
#ifdef SUPERCHIP_HAVE_CUDA
  if (impl_->config.cuda) {
    // cudaMemcpyDefault lets unified addressing tell device from host pointers.
    SUPERCHIP_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault));
    return;
  }
#endif
  std::memcpy(dst, src, nbytes);
}

TierStats MemoryManager::stats(Tier tier) const noexcept {
  TierStats s = impl_->tier(tier).stats();
  if (tier == Tier::kHost) s.num_spills = impl_->spills.load(std::memory_order_relaxed);
  return s;
}

void MemoryManager::empty_cache() noexcept {
  impl_->hbm.empty_cache();
  impl_->host.empty_cache();
}

size_t MemoryManager::empty_cache(Tier tier) noexcept { return impl_->tier(tier).empty_cache(); }

void MemoryManager::reset_peak() noexcept {
  impl_->hbm.reset_peak();
  impl_->host.reset_peak();
}

void MemoryManager::reset_accumulated() noexcept {
  impl_->hbm.reset_accumulated();
  impl_->host.reset_accumulated();
  impl_->spills.store(0, std::memory_order_relaxed);
}

void MemoryManager::set_capacity(Tier tier, size_t capacity_bytes) {
  impl_->tier(tier).set_capacity(capacity_bytes);
}

const MemoryConfig& MemoryManager::config() const noexcept { return impl_->config; }

void MemoryManager::check_invariants() const {
  impl_->hbm.check_invariants();
  impl_->host.check_invariants();
  // Emulated hbm and host memory come from the same heap: a block must be in one tier only.
  std::unordered_set<const void*> hbm_blocks;
  for (const void* p : impl_->hbm.block_pointers()) hbm_blocks.insert(p);
  for (const void* p : impl_->host.block_pointers()) {
    if (hbm_blocks.count(p) != 0) {
      throw std::logic_error("superchip: invariant violated: a block is in both tiers");
    }
  }
}

}  // namespace superchip
