#include "allocator/MemoryManager.h"

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
};

MemoryManager::MemoryManager(const MemoryConfig& config) : impl_(std::make_unique<Impl>(config)) {}

MemoryManager::~MemoryManager() = default;

void* MemoryManager::allocate(size_t nbytes, Tier tier) { return impl_->tier(tier).allocate(nbytes); }

void MemoryManager::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (impl_->hbm.free(ptr) || impl_->host.free(ptr)) return;
  std::fprintf(stderr, "superchip: free(%p): not a live block of this allocator; ignored\n", ptr);
}

void MemoryManager::account_external(Tier tier, size_t nbytes) {
  impl_->tier(tier).account_external(nbytes);
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

TierStats MemoryManager::stats(Tier tier) const noexcept { return impl_->tier(tier).stats(); }

void MemoryManager::empty_cache() noexcept {
  impl_->hbm.empty_cache();
  impl_->host.empty_cache();
}

void MemoryManager::reset_peak() noexcept {
  impl_->hbm.reset_peak();
  impl_->host.reset_peak();
}

void MemoryManager::reset_accumulated() noexcept {
  impl_->hbm.reset_accumulated();
  impl_->host.reset_accumulated();
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
