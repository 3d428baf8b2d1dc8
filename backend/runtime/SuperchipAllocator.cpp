#include "backend/runtime/SuperchipAllocator.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "allocator/Topology.h"
#include "backend/engine/OffloadEngine.h"
#include "backend/stream/WeightStreamer.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipGuard.h"
#include "backend/runtime/StorageLease.h"

namespace superchip {
namespace {

// ---- block DataPtrs: context == data, owned by one device's MemoryManager ----

MemoryManager* owner_of(const void* ptr) noexcept {
  for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
    MemoryManager* m = memory_if_created(i);
    if (m && m->tier_of(ptr).has_value()) return m;
  }
  return nullptr;
}

void free_block_now(void* ptr) noexcept {
  if (MemoryManager* m = owner_of(ptr)) {
    m->free(ptr);
  } else {
    std::fprintf(stderr, "superchip: internal error: freeing %p, which no device owns\n", ptr);
  }
}

// ---- stream-ordered reuse: Note [record_stream] ----
// A block recorded on streams (Tensor.record_stream) is, when its storage dies, not returned
// to the MemoryManager at once: an event is recorded on each of those streams and the block
// waits in `pending` until every event has completed; allocate() and empty_cache() retire the
// completed ones. So a block is never handed out again while a stream that used it may still
// run. Invariant: a pointer is in at most one of `recorded` (live) and `pending` (dead).
struct StreamEvent {
  void* event;
  c10::DeviceIndex device;
  c10::StreamId stream;
};

struct PendingFree {
  void* ptr;
  std::vector<StreamEvent> events;
};

// Note [Blocks and the streams that allocate them]
// CUDA's caching allocator gives a freed block only to allocations on the stream that
// allocated it (its work on the block is then ahead in stream order); superchip's tiers are
// one pool for all streams. While every block comes from one stream that is the same thing,
// so that case stays free of events. From the first allocation on a second stream of a device
// (FSDP2's all-gather and reduce-scatter streams, a user's side stream; not the engine's
// worker, whose jobs end with its streams synchronized) each block remembers the stream that allocated it (`allocated_on`; none: the first stream),
// and a dead block waits in `pending` for an event on that stream, as a recorded one does
// (Note [record_stream]): a block is never handed to another stream while the kernels of the
// stream it was allocated on may still use it. Blocks freed before the switch went back to
// the pool at once; the switch synchronizes the first stream, once, so none of them is still
// in use either. Streams never switch back (a process that used two streams likely will again).
constexpr size_t kTrackedDevices = 64;  // Runtime's most devices

struct DeviceStreams {
  std::atomic<bool> known{false};  // some block was allocated on the device (set once)
  std::atomic<c10::StreamId> first{0};
  std::atomic<bool> multi{false};
  std::atomic<bool> switched{false};  // multi, and the first stream was synchronized since
};

struct StreamUses {
  std::mutex mutex;
  std::unordered_map<void*, std::vector<c10::Stream>> recorded;
  std::vector<PendingFree> pending;
  std::array<DeviceStreams, kTrackedDevices> devices;
  std::atomic<bool> any_multi{false};  // some device is multi-stream: frees look up their block
  std::unordered_map<void*, c10::Stream> allocated_on;  // multi-stream devices, streams but the first
};

StreamUses& stream_uses() {
  static auto* u = new StreamUses();  // leaked: storages die during interpreter teardown
  return *u;
}

const c10::impl::DeviceGuardImplInterface* superchip_guard() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
}

// Note [Host blocks and GPU readers]
// Under the CUDA executor, kernels read and write host-tier blocks in place (pinned and mapped):
// spilled activations, host weights read in place, optimizer state. A tensor may die while a
// kernel queued on it has not run; an hbm block can go back to the pool at once (its next user
// queues behind on the same stream, as in CUDA's caching allocator), but a host block's next
// user may write it from the CPU (the optimizer) or from another stream (the engine's worker),
// under the kernel's feet. So a host block freed under the CUDA executor counts as used by the
// freeing thread's current stream of its device (Note [record_stream]): it is reused once that
// stream has passed the free. Found by review; not yet run on a GPU.
void note_host_block_use(void* ptr, std::vector<c10::Stream>& streams) noexcept {
  if (executor() != Executor::kCuda) return;
  MemoryManager* m = owner_of(ptr);
  if (m == nullptr || m->tier_of(ptr) != Tier::kHost) return;
  try {
    const auto device = static_cast<c10::DeviceIndex>(m->config().device_index);
    const c10::Stream cur = superchip_guard()->getStream(c10::Device(c10::DeviceType::PrivateUse1, device));
    for (const c10::Stream& s : streams) {
      if (s == cur) return;
    }
    streams.push_back(cur);
  } catch (...) {
    // No stream to order with (CUDA shutting down): freed at once, as before.
  }
}

// A new block of `device`: on a second stream of the device, the switch to stream-ordered
// reuse (Note [Blocks and the streams that allocate them]). Never throws: without a stream
// to ask (CUDA shutting down) the block is taken for the first stream's.
void note_allocation(void* ptr, c10::DeviceIndex device) noexcept {
  if (ptr == nullptr || device < 0 || device >= c10::DeviceIndex(kTrackedDevices)) return;
  // The engine's worker ends each job with its streams synchronized (GpuOrder.cpp), so its
  // blocks have no queued work left when anyone frees them: taken for the first stream's.
  if (OffloadEngine::on_worker()) return;
  StreamUses& u = stream_uses();
  DeviceStreams& d = u.devices[static_cast<size_t>(device)];
  try {
    const c10::Stream cur = superchip_guard()->getStream(c10::Device(c10::DeviceType::PrivateUse1, device));
    if (d.known.load(std::memory_order_acquire) && cur.id() == d.first.load(std::memory_order_relaxed)) {
      return;  // the common case: one stream, no lock
    }
    std::unique_lock<std::mutex> g(u.mutex);
    if (!d.known.load(std::memory_order_relaxed)) {
      d.first.store(cur.id(), std::memory_order_relaxed);
      d.known.store(true, std::memory_order_release);
      return;
    }
    if (cur.id() == d.first.load(std::memory_order_relaxed)) return;
    u.allocated_on.insert_or_assign(ptr, cur);
    if (d.switched.load(std::memory_order_acquire)) return;
    d.multi.store(true, std::memory_order_release);
    u.any_multi.store(true, std::memory_order_release);
    const c10::Stream first(c10::Stream::UNSAFE, cur.device(), d.first.load(std::memory_order_relaxed));
    g.unlock();
    // Blocks the first stream freed to the pool may still be in its queued kernels' hands,
    // this one among them: it goes to the caller, and so to its stream, only after them. Until
    // that wait has ended once, every allocation on another stream waits too (a second one
    // while the first waits could be handed such a block).
    superchip_guard()->synchronizeStream(first);
    d.switched.store(true, std::memory_order_release);
  } catch (...) {
  }
}

// The stream that allocated a block of a multi-stream device, added to `streams`.
void note_allocating_stream(void* ptr, std::vector<c10::Stream>& streams) noexcept {
  if (!stream_uses().any_multi.load(std::memory_order_acquire)) return;  // one stream: no lookup
  MemoryManager* m = owner_of(ptr);
  if (m == nullptr) return;
  const auto device = static_cast<c10::DeviceIndex>(m->config().device_index);
  if (device < 0 || device >= c10::DeviceIndex(kTrackedDevices)) return;
  StreamUses& u = stream_uses();
  DeviceStreams& d = u.devices[static_cast<size_t>(device)];
  if (!d.multi.load(std::memory_order_acquire)) return;
  c10::Stream s(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, device),
                d.first.load(std::memory_order_relaxed));
  {
    std::lock_guard<std::mutex> g(u.mutex);
    auto it = u.allocated_on.find(ptr);
    if (it != u.allocated_on.end()) {
      s = it->second;
      u.allocated_on.erase(it);
    }
  }
  for (const c10::Stream& t : streams) {
    if (t == s) return;
  }
  streams.push_back(s);
}

void block_delete(void* ptr) noexcept {
  if (ptr == nullptr) return;
  StreamUses& u = stream_uses();
  std::vector<c10::Stream> streams;
  {
    std::lock_guard<std::mutex> g(u.mutex);
    auto it = u.recorded.find(ptr);
    if (it != u.recorded.end()) {
      streams = std::move(it->second);
      u.recorded.erase(it);
    }
  }
  note_allocating_stream(ptr, streams);
  note_host_block_use(ptr, streams);
  if (streams.empty()) {
    free_block_now(ptr);
    return;
  }
  PendingFree p{ptr, {}};
  bool done = true;  // every stream already past the free (an idle GPU, the emulation)
  for (const c10::Stream& s : streams) {
    void* event = nullptr;
    try {
      superchip_guard()->record(&event, s, s.device_index(), c10::EventFlag::PYTORCH_DEFAULT);
      p.events.push_back({event, s.device_index(), s.id()});
      done = done && superchip_guard()->queryEvent(event);
    } catch (...) {
      // Without an event the order cannot be kept lazily: wait for the stream instead. When
      // that fails too (a graph capture, a failing GPU) and an event was recorded, the block
      // waits for it with the other pending ones rather than being reused at once.
      try {
        superchip_guard()->synchronizeStream(s);
      } catch (...) {
        if (!p.events.empty() && p.events.back().event == event) done = false;
      }
    }
  }
  if (done) {
    for (const StreamEvent& e : p.events) superchip_guard()->destroyEvent(e.event, e.device);
    free_block_now(ptr);
    return;
  }
  std::lock_guard<std::mutex> g(u.mutex);
  u.pending.push_back(std::move(p));
}

// Frees the pending blocks whose streams have passed their events. Never throws.
void retire_pending_frees() noexcept {
  StreamUses& u = stream_uses();
  std::vector<PendingFree> ready;
  {
    std::lock_guard<std::mutex> g(u.mutex);
    if (u.pending.empty()) return;
    // Events of one stream complete in the order they were recorded, which is the order of
    // `pending` (give or take two threads freeing at once: a block retired a call later). So
    // one incomplete event of a stream answers for the later ones: one query per stream, not
    // one per block, however many blocks a busy GPU leaves waiting.
    std::vector<std::pair<c10::DeviceIndex, c10::StreamId>> busy;
    auto keep = u.pending.begin();
    for (auto it = u.pending.begin(); it != u.pending.end(); ++it) {
      bool done = true;
      for (size_t k = 0; k < it->events.size() && done; ++k) {
        const std::pair<c10::DeviceIndex, c10::StreamId> key{it->events[k].device, it->events[k].stream};
        if (std::find(busy.begin(), busy.end(), key) != busy.end()) {
          done = false;
          break;
        }
        try {
          done = superchip_guard()->queryEvent(it->events[k].event);
        } catch (...) {
          done = false;
        }
        if (!done) busy.push_back(key);
      }
      if (done) {
        ready.push_back(std::move(*it));
      } else {
        if (keep != it) *keep = std::move(*it);  // never self-move: it would empty `events`
        ++keep;
      }
    }
    u.pending.erase(keep, u.pending.end());
  }
  for (PendingFree& p : ready) {
    for (const StreamEvent& e : p.events) superchip_guard()->destroyEvent(e.event, e.device);
    free_block_now(p.ptr);
  }
}

// Out of a tier: blocks waiting for their streams may be what is missing. Waits for every
// pending free's events, then frees them; whether any block was freed.
bool drain_pending_frees() noexcept {
  StreamUses& u = stream_uses();
  std::vector<PendingFree> all;
  {
    std::lock_guard<std::mutex> g(u.mutex);
    all.swap(u.pending);
  }
  for (PendingFree& p : all) {
    for (const StreamEvent& e : p.events) {
      try {
        superchip_guard()->synchronizeEvent(e.event);
      } catch (...) {
      }
      superchip_guard()->destroyEvent(e.event, e.device);
    }
    free_block_now(p.ptr);
  }
  return !all.empty();
}

// A block's DataPtr: context == data, freed through block_delete.
c10::DataPtr block_data_ptr(void* p, c10::DeviceIndex device) noexcept {
  note_allocation(p, device);
  return {p, p, &block_delete, c10::Device(c10::DeviceType::PrivateUse1, device)};
}

// ---- adopted DataPtrs: an executor kernel's output, accounted as external hbm bytes ----
// Their context is the data pointer itself, as for blocks, so c10 counts them as simple
// DataPtrs and torch._lazy_clone can wrap them (its copy-on-write steal rebuilds a DataPtr
// from the context and asserts context == data). The AdoptedBlock is found by address.

struct AdoptedBlock {
  c10::Storage executor_storage;  // keeps the executor's memory alive
  MemoryManager* memory;
  size_t nbytes;
  Tier tier;                      // the tier it is charged to
};

struct AdoptedRegistry {
  std::mutex mutex;
  // A multimap: two executor storages never share a data pointer, but one that did must
  // not lose its accounting.
  std::unordered_multimap<const void*, AdoptedBlock*> blocks;
};

AdoptedRegistry& adopted_registry() {
  static auto* r = new AdoptedRegistry();  // leaked on purpose: deleters run at exit
  return *r;
}

void adopted_delete(void* data) noexcept {
  AdoptedBlock* a = nullptr;
  {
    AdoptedRegistry& r = adopted_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.blocks.find(data);
    if (it == r.blocks.end()) {
      std::fprintf(stderr, "superchip: internal error: releasing adopted memory %p, which is not registered\n", data);
      return;
    }
    a = it->second;
    r.blocks.erase(it);
  }
  a->memory->release_external(a->tier, a->nbytes);
  delete a;  // drops the executor storage outside the registry lock
}

c10::CachingDeviceAllocator::DeviceStats to_device_stats(const TierStats& t) {
  using c10::CachingAllocator::StatType;
  c10::CachingDeviceAllocator::DeviceStats s;
  const auto agg = static_cast<size_t>(StatType::AGGREGATE);
  auto fill = [](c10::CachingAllocator::Stat& st, int64_t current, int64_t peak, int64_t allocated,
                 int64_t freed) {
    st.current = current;
    st.peak = peak;
    st.allocated = allocated;  // cumulative, as torch.cuda's (memory_summary's "Tot Alloc")
    st.freed = freed;
  };
  fill(s.allocated_bytes[agg], t.allocated_bytes, t.peak_allocated_bytes, t.allocated_bytes_total,
       t.freed_bytes_total);
  fill(s.active_bytes[agg], t.allocated_bytes, t.peak_allocated_bytes, t.allocated_bytes_total,
       t.freed_bytes_total);
  fill(s.reserved_bytes[agg], t.reserved_bytes, t.peak_reserved_bytes, t.reserved_bytes_total,
       t.released_bytes_total);
  fill(s.requested_bytes[agg], t.requested_bytes, t.peak_requested_bytes, t.requested_bytes_total,
       t.requested_freed_total);
  fill(s.allocation[agg], t.active_allocations, t.peak_active_allocations, t.num_allocs, t.num_frees);
  fill(s.active[agg], t.active_allocations, t.peak_active_allocations, t.num_allocs, t.num_frees);
  fill(s.segment[agg], t.segments, t.peak_segments, t.num_segment_allocs, t.num_segment_frees);
  s.num_device_alloc = t.num_segment_allocs;
  s.num_device_free = t.num_segment_frees;
  s.num_ooms = t.num_ooms;
  return s;
}

// ---- pinned host memory for CPU tensors (pin_memory=True) ----

MemoryManager& pinned_memory() {
  static MemoryManager* m = [] {
    MemoryConfig cfg;
    cfg.cuda = false;
    return new MemoryManager(cfg);  // leaked on purpose: outlives every tensor
  }();
  return *m;
}

// Note [Pinned interior pointers]: is_pinned() of a storage sliced from a pinned one
// (untyped_storage()[k:], as torch's own storage tests rewrap) asks about an address inside a
// pinned block, which CUDA's cudaPointerGetAttributes answers for any address of a pinned
// allocation; the allocator knows blocks by their start. So the live pinned blocks' extents
// are kept here too (pinning is per batch at most: a map is cheap enough).
struct PinnedExtents {
  std::mutex mu;
  std::map<uintptr_t, size_t> blocks;  // start -> bytes asked for
};

PinnedExtents& pinned_extents() {
  static auto* e = new PinnedExtents();  // leaked on purpose, as pinned_memory()
  return *e;
}

void pinned_delete(void* ptr) noexcept {
  if (ptr != nullptr) {
    PinnedExtents& e = pinned_extents();
    std::lock_guard<std::mutex> lock(e.mu);
    e.blocks.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  pinned_memory().free(ptr);
}

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = nullptr;
    try {
      p = pinned_memory().allocate(nbytes, Tier::kHost);
    } catch (const OutOfTierMemory& e) {
      rethrow_as_torch_oom(e);
    }
    if (p != nullptr) {
      PinnedExtents& e = pinned_extents();
      std::lock_guard<std::mutex> lock(e.mu);
      e.blocks[reinterpret_cast<uintptr_t>(p)] = nbytes;
    }
    return {p, p, &pinned_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

// Note [The host allocator]
// torch.accelerator.empty_host_cache() asks at::getHostAllocator(PrivateUse1) for the
// accelerator's host (pinned) allocator and calls it without a null check (torch 2.13's
// _accelerator_emptyHostCache; later torch reads its statistics the same way): superchip
// registered none, and once a superchip tensor existed the call crashed the process with a
// segmentation fault (found by PyTorch's test_accelerator.py run on superchip). This is the
// allocator behind pin_memory=True seen through that interface: with the CUDA executor
// CUDA's own host allocator (the one SuperchipHooks::getPinnedMemoryAllocator hands out),
// superchip streams translated to the executor's; emulated, the superchip pinned pool, whose
// copies are synchronous, so a block has no stream use to wait for.
class SuperchipHostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (at::HostAllocator* c = cuda()) return c->allocate(nbytes);
    return pinned_allocator()->allocate(nbytes);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    if (at::HostAllocator* c = cuda()) return c->raw_deleter();
    return &pinned_delete;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    if (at::HostAllocator* c = cuda()) {
      return c->record_event(ptr, ctx,
                             stream.device_type() == c10::DeviceType::PrivateUse1 ? to_executor_stream(stream)
                                                                                  : stream);
    }
    return is_pinned_ptr(ptr);
  }
  void empty_cache() override {
    if (at::HostAllocator* c = cuda()) return c->empty_cache();
    pinned_memory().empty_cache();
  }
  at::HostStats get_stats() override {
    if (at::HostAllocator* c = cuda()) return c->get_stats();
    const TierStats t = pinned_memory().stats(Tier::kHost);
    auto fill = [](c10::CachingAllocator::Stat& s, int64_t current, int64_t peak, int64_t in, int64_t out) {
      s.current = current;
      s.peak = peak;
      s.allocated = in;
      s.freed = out;
    };
    at::HostStats s;
    fill(s.active_requests, t.active_allocations, t.peak_active_allocations, t.num_allocs, t.num_frees);
    fill(s.active_bytes, t.allocated_bytes, t.peak_allocated_bytes, t.allocated_bytes_total, t.freed_bytes_total);
    fill(s.allocations, t.segments, t.peak_segments, t.num_segment_allocs, t.num_segment_frees);
    fill(s.allocated_bytes, t.reserved_bytes, t.peak_reserved_bytes, t.reserved_bytes_total,
         t.released_bytes_total);
    s.num_host_alloc = t.num_segment_allocs;
    s.num_host_free = t.num_segment_frees;
    return s;
  }
  void reset_accumulated_stats() override {
    if (at::HostAllocator* c = cuda()) return c->reset_accumulated_stats();
    pinned_memory().reset_accumulated();
  }
  void reset_peak_stats() override {
    if (at::HostAllocator* c = cuda()) return c->reset_peak_stats();
    pinned_memory().reset_peak();
  }

 private:
  static at::HostAllocator* cuda() {
    return executor() == Executor::kCuda ? at::getHostAllocator(c10::DeviceType::CUDA) : nullptr;
  }
};

SuperchipHostAllocator g_host_allocator;
REGISTER_HOST_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_host_allocator)

}  // namespace

// An engine job may still read or write the bytes a swap is about to free (an asynchronous
// step of a parameter reloaded or moved by hand): it finishes first. The worker never swaps.
static void wait_for_engine_jobs(const c10::StorageImpl& storage) {
  if (!OffloadEngine::on_worker()) OffloadEngine::get().wait_for_storage(&storage);
}

void note_block_allocated(void* ptr, c10::DeviceIndex device) noexcept { note_allocation(ptr, device); }

void free_block(void* ptr) noexcept { block_delete(ptr); }

[[noreturn]] void rethrow_as_torch_oom(const OutOfTierMemory& e) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
}

c10::DataPtr allocate_in_tier(size_t nbytes, Tier tier, c10::DeviceIndex device) {
  MemoryManager& m = memory(device);
  // Blocks waiting for their streams are drained before the attempt that may fail: an error
  // is counted (num_ooms) only where one is raised (a failure the drain then cured counted
  // one, and a second failure two: found by review).
  void* p = m.try_allocate(nbytes, tier);
  if (p == nullptr && nbytes > 0) {
    drain_pending_frees();
    try {
      p = m.allocate(nbytes, tier);
    } catch (const OutOfTierMemory& e) {
      rethrow_as_torch_oom(e);
    }
  }
  return block_data_ptr(p, device);
}

c10::DataPtr allocate_placed(size_t nbytes, c10::DeviceIndex device, size_t hbm_limit) {
  MemoryManager& m = memory(device);
  MemoryManager::Placed placed{nullptr, Tier::kHbm};
  try {
    placed = m.allocate_placed(nbytes, hbm_limit);
  } catch (const OutOfTierMemory& e) {
    if (!drain_pending_frees()) rethrow_as_torch_oom(e);
    try {
      placed = m.allocate_placed(nbytes, hbm_limit);
    } catch (const OutOfTierMemory& again) {
      rethrow_as_torch_oom(again);
    }
  }
  return block_data_ptr(placed.ptr, device);
}

void place_incoming_weights(c10::StorageImpl& storage) {
  const c10::DeviceIndex device = storage.device().index();
  MemoryManager& m = memory(device);
  const size_t limit = m.weights_limit();
  const size_t nbytes = storage.nbytes();
  if (limit == 0 || nbytes == 0 || !m.host_placeable(nbytes) || storage_tier(storage) != Tier::kHbm) return;
  if (static_cast<size_t>(m.stats(Tier::kHbm).allocated_bytes) <= limit) return;
  if (storage_has_lease(storage)) return;  // a collective uses the bytes: leave them
  wait_for_engine_jobs(storage);
  // Past the limit: the weights go to host, where allocate_placed() falls back anyway.
  void* p = nullptr;
  try {
    p = m.allocate(nbytes, Tier::kHost);
  } catch (const OutOfTierMemory&) {
    return;  // host is full: the weights stay in hbm
  }
  c10::DataPtr old = storage.set_data_ptr(block_data_ptr(p, device));
}

void place_registered_weight(c10::StorageImpl& storage) {
  MemoryManager& m = memory(storage.device().index());
  const size_t limit = m.weights_limit();
  const size_t nbytes = storage.nbytes();
  if (limit == 0 || nbytes == 0 || !m.host_placeable(nbytes) || storage_tier(storage) != Tier::kHbm) return;
  if (static_cast<size_t>(m.stats(Tier::kHbm).allocated_bytes) <= limit) return;
  if (storage_has_lease(storage)) return;
  try {
    move_storage_to_tier(storage, Tier::kHost);
  } catch (const c10::Error&) {
    // host is full: the weight stays in hbm, like one copied in
  }
}

// Note [GPU outputs past the hbm budget]
// A forwarded CUDA kernel's output is allocated by torch's CUDA caching allocator, so it is
// in GPU memory whatever superchip's budget says. Charged to hbm past that budget, it made
// the op fail with an out-of-memory error while host had room (seen on the H100:
// test_oom_from_an_op_output), where an allocation of ours would have gone to host. So such
// an output moves: a block is placed as any allocation is (hbm, else host, else the error
// naming both tiers), the device is synchronized so the kernel that wrote the bytes has
// finished, the bytes are copied, and the executor's memory goes back to its allocator. A
// copy per spilled output: the cost of running past the budget, which `num_spills` counts.
namespace {

c10::DataPtr move_gpu_output_out_of_hbm(const c10::Storage& executor_storage, c10::DeviceIndex device) {
  const size_t nbytes = executor_storage.nbytes();
  // allocate_placed() never spills a block under kMmapThreshold (host_placeable): it would fail
  // on the full hbm. The output exists already; host is the only place left for it.
  c10::DataPtr placed = memory(device).host_placeable(nbytes) ? allocate_placed(nbytes, device)
                                                              : allocate_in_tier(nbytes, Tier::kHost, device);
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->synchronizeDevice(device);
  memory(device).copy(placed.get(), executor_storage.data(), nbytes);
  return placed;
}

}  // namespace

c10::DataPtr adopt_executor_storage(const c10::Storage& executor_storage, c10::DeviceIndex device) {
  MemoryManager& m = memory(device);
  const size_t nbytes = executor_storage.nbytes();
  void* data = const_cast<void*>(executor_storage.data());
  const c10::Device superchip_device(c10::DeviceType::PrivateUse1, device);
  // No bytes to keep alive (an empty result): nothing to account or register.
  if (data == nullptr) return c10::DataPtr(nullptr, superchip_device);
  // The CPU executor's outputs are host memory whichever tier they count in, so a full hbm
  // charges them to host (Note [Placement]); a GPU's outputs are in its memory: hbm, or moved
  // to host past hbm's budget (Note [GPU outputs past the hbm budget]).
  Tier tier = Tier::kHbm;
  try {
    if (executor() == Executor::kCpu) {
      tier = m.account_external_placed(nbytes);
    } else {
      if (!m.try_account_external(Tier::kHbm, nbytes)) return move_gpu_output_out_of_hbm(executor_storage, device);
    }
  } catch (const OutOfTierMemory& e) {
    rethrow_as_torch_oom(e);
  }
  auto* block = new AdoptedBlock{executor_storage, &m, nbytes, tier};
  {
    AdoptedRegistry& r = adopted_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.blocks.emplace(data, block);
  }
  return {data, data, &adopted_delete, superchip_device};
}

Tier storage_tier(const c10::StorageImpl& storage) {
  // By address, not by deleter: a copy-on-write DataPtr wraps a block's deleter.
  const void* data = storage.data_ptr().get();
  if (MemoryManager* m = owner_of(data)) return m->tier_of(data).value_or(Tier::kHbm);
  if (data != nullptr) {
    AdoptedRegistry& r = adopted_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.blocks.find(const_cast<void*>(data));
    if (it != r.blocks.end()) return it->second->tier;
  }
  return Tier::kHbm;  // empty storages (where they would allocate)
}

// Copies `nbytes` from the block a storage is leaving into the block replacing it. On the CUDA
// executor MemoryManager::copy is a cudaMemcpy on the legacy default stream, which is not
// ordered with the non-blocking streams torch and the engine queue kernels on (a pool stream,
// the engine worker's side stream, a user's stream): a kernel still writing the old block, or
// one writing the old block's next owner while a device-to-device cudaMemcpy still reads it
// (it returns before the copy ends), would race. So the device is idle on both sides: a tier
// move or a resize is rare, and costs a whole-block copy anyway. Found by review; not yet run
// on a GPU.
static void copy_between_blocks(c10::DeviceIndex device, void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return;
  const c10::impl::DeviceGuardImplInterface* cuda =
      executor() == Executor::kCuda ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA) : nullptr;
  if (cuda != nullptr) cuda->synchronizeDevice(executor_device(device).index());
  memory(device).copy(dst, src, nbytes);
  if (cuda != nullptr) cuda->synchronizeDevice(executor_device(device).index());
}

// Copies the bytes of `storage` into `fresh` (a block of `tier`) and swaps them in.
static void swap_in(c10::StorageImpl& storage, c10::DataPtr fresh, Tier tier) {
  const size_t nbytes = storage.nbytes();
  copy_between_blocks(storage.device().index(), fresh.get(), storage.data(), nbytes);
  WeightStreamer::get().note_written(&storage);
  // The old DataPtr is released when `old` leaves scope, after the swap.
  c10::DataPtr old = storage.set_data_ptr(std::move(fresh));
  if (tier == Tier::kHost) WeightStreamer::get().note_moved_to_host(&storage);
}

void move_storage_to_tier(c10::StorageImpl& storage, Tier tier) {
  if (storage_tier(storage) == tier) return;
  check_no_lease(storage, "superchip.move_to_tier");
  wait_for_engine_jobs(storage);
  // May raise: nothing changed yet.
  swap_in(storage, allocate_in_tier(storage.nbytes(), tier, storage.device().index()), tier);
}

bool try_move_storage_to_tier(c10::StorageImpl& storage, Tier tier) {
  if (storage_tier(storage) == tier) return true;
  if (storage_has_lease(storage)) return false;
  wait_for_engine_jobs(storage);
  const c10::DeviceIndex device = storage.device().index();
  void* p = storage.nbytes() > 0 ? memory(device).try_allocate(storage.nbytes(), tier) : nullptr;
  if (p == nullptr && storage.nbytes() > 0) return false;
  swap_in(storage, block_data_ptr(p, device), tier);
  return true;
}

void resize_storage_bytes(c10::StorageImpl& storage, size_t nbytes) {
  TORCH_CHECK(storage.resizable(), "Trying to resize a superchip storage that is not resizable.");
  const c10::DeviceIndex device = storage.device().index();
  const Tier tier = storage_tier(storage);
  // An hbm storage may grow into host when hbm is full (Note [Placement]); a host storage stays
  // in host while host has room, and then goes where any allocation would: only both tiers
  // full is an error (a host tensor's resize_ raised host's out-of-memory error with hbm
  // free: found by review).
  c10::DataPtr fresh;
  void* host = tier == Tier::kHost ? memory(device).try_allocate(nbytes, Tier::kHost) : nullptr;
  fresh = host != nullptr ? block_data_ptr(host, device) : allocate_placed(nbytes, device);
  const size_t keep = std::min(nbytes, storage.nbytes());
  if (storage.data() != nullptr) copy_between_blocks(device, fresh.get(), storage.data(), keep);
  c10::DataPtr old = storage.set_data_ptr(std::move(fresh));
  storage.set_nbytes(nbytes);
  WeightStreamer::get().note_written(&storage);
}

// ---- SuperchipAllocator ----

c10::DataPtr SuperchipAllocator::allocate(size_t nbytes) {
  retire_pending_frees();
  return allocate_placed(nbytes, current_device());
}

c10::DeleterFnPtr SuperchipAllocator::raw_deleter() const { return &block_delete; }

bool SuperchipAllocator::is_simple_data_ptr(const c10::DataPtr& data_ptr) const {
  return data_ptr.get_deleter() == &block_delete || data_ptr.get_deleter() == &adopted_delete;
}

void SuperchipAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  memory(current_device()).copy(dest, src, count);
}

size_t release_cached_memory_for_executor(c10::DeviceIndex device) noexcept {
  drain_pending_frees();
  size_t released = 0;
  if (executor() == Executor::kCuda) {
    if (MemoryManager* m = memory_if_created(device)) released += m->empty_cache(Tier::kHbm);
    return released;
  }
  for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
    if (MemoryManager* m = memory_if_created(i)) {
      released += m->empty_cache(Tier::kHbm) + m->empty_cache(Tier::kHost);
    }
  }
  return released;
}

void SuperchipAllocator::emptyCache(c10::MempoolId_t /*mempool_id*/) {
  // What torch.superchip.empty_cache() frees, whoever asks (torch.accelerator.empty_cache(),
  // accelerate's free_memory): the tensors of the offload engine's finished jobs (held until a
  // caller releases them), the weight streamer's unused staged copies and a deleted model's
  // staging arena; then every tier's cached blocks.
  if (!OffloadEngine::on_worker()) OffloadEngine::get().release_finished();
  WeightStreamer::get().release_staging();
  retire_pending_frees();
  for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
    if (MemoryManager* m = memory_if_created(i)) m->empty_cache();
  }
}

void SuperchipAllocator::recordStream(const c10::DataPtr& ptr, c10::Stream stream) {
  if (ptr.get() == nullptr) return;  // an empty storage holds nothing
  if (ptr.get_deleter() == &adopted_delete) {
    // Adopted executor memory (most op outputs on the CUDA executor) belongs to CUDA's caching
    // allocator: the record goes to it, on the executor's stream (before, it was dropped, and
    // a block recorded on a side stream could be reused while that stream still read it).
    if (executor() != Executor::kCuda) return;  // the CPU executor's memory is never reused early
    c10::Storage executor_storage;  // its DataPtr (CUDA's deleter) is what that allocator keys on
    {
      AdoptedRegistry& r = adopted_registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      auto it = r.blocks.find(ptr.get());
      if (it == r.blocks.end()) return;
      executor_storage = it->second->executor_storage;
    }
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
        ->recordDataPtrOnStream(executor_storage.data_ptr(), to_executor_stream(stream));
    return;
  }
  if (ptr.get_deleter() != &block_delete) return;
  StreamUses& u = stream_uses();
  std::lock_guard<std::mutex> g(u.mutex);
  auto& streams = u.recorded[ptr.get()];
  for (const c10::Stream& s : streams) {
    if (s == stream) return;
  }
  streams.push_back(stream);
}

size_t pending_stream_frees() {
  StreamUses& u = stream_uses();
  std::lock_guard<std::mutex> g(u.mutex);
  return u.pending.size();
}

c10::CachingDeviceAllocator::DeviceStats SuperchipAllocator::getDeviceStats(c10::DeviceIndex device) {
  const MemoryManager& m = memory(resolve_device(device));
  c10::CachingDeviceAllocator::DeviceStats s = to_device_stats(m.stats(Tier::kHbm));
  // An allocation that fails in both tiers (or in host, where it was asked for) is the
  // device's out-of-memory error too: torch.cuda counts every one (found by review: 0 here).
  s.num_ooms += m.stats(Tier::kHost).num_ooms;
  return s;
}

void SuperchipAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  memory(resolve_device(device)).reset_accumulated();
}

void SuperchipAllocator::resetPeakStats(c10::DeviceIndex device) {
  memory(resolve_device(device)).reset_peak();
}

std::pair<size_t, size_t> SuperchipAllocator::getMemoryInfo(c10::DeviceIndex device) {
  const c10::DeviceIndex index = resolve_device(device);
  const TierStats s = memory(index).stats(Tier::kHbm);
  if (s.capacity_bytes == 0) {
    // No budget: what the device itself has (the GPU, or the host emulating it).
    if (executor() == Executor::kCuda) return cuda_memory_info(index);
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long avail = sysconf(_SC_AVPHYS_PAGES);
    const long page = sysconf(_SC_PAGESIZE);
    return {static_cast<size_t>(std::max(0L, avail)) * page, static_cast<size_t>(std::max(0L, pages)) * page};
  }
  const size_t total = static_cast<size_t>(s.capacity_bytes);
  const size_t used = static_cast<size_t>(s.reserved_bytes);
  return {total > used ? total - used : 0, total};
}

SuperchipAllocator& superchip_allocator() {
  static SuperchipAllocator a;
  return a;
}

c10::Allocator* pinned_allocator() {
  static PinnedAllocator a;
  return &a;
}

bool is_pinned_ptr(const void* ptr) {
  if (ptr == nullptr) return false;
  // Note [Pinned interior pointers]
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  PinnedExtents& e = pinned_extents();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.blocks.upper_bound(a);
  if (it == e.blocks.begin()) return false;
  --it;
  return a == it->first || a < it->first + it->second;
}

}  // namespace superchip
