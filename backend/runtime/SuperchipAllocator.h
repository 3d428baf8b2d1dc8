// SuperchipAllocator: the c10::DeviceAllocator of the superchip device. Every superchip
// storage's DataPtr is one of two kinds, and its tier follows from the kind:
//   block   - memory from the device's MemoryManager (context == data); tier from the manager;
//   adopted - an output a forwarded executor kernel allocated itself (context == data); a
//             registry by address keeps the executor's storage alive and its bytes are
//             accounted as external in `hbm`.
// Deleters are noexcept and never take the GIL. Thread-safe.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Storage.h>

#include "allocator/MemoryManager.h"

namespace superchip {

class SuperchipAllocator final : public c10::DeviceAllocator {
 public:
  // New storage memory goes to the `hbm` tier of the current device.
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  // Both kinds of DataPtr own their bytes alone (no blind aliases), so torch._lazy_clone may
  // share them copy-on-write, as it shares CPU memory.
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  // Marks a block as used by `stream`: when its storage dies, the block is reused only after
  // the work queued on `stream` until then has run (Note [record_stream]). Adopted executor
  // memory is recorded with the executor's allocator (CUDA's), on the executor stream.
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override;
  // Figures of the `hbm` tier, so torch.accelerator.memory_allocated() means what
  // torch.cuda.memory_allocated() means; the host tier is in superchip.memory_stats().
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  // (free, total) of the `hbm` tier budget.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;
};

SuperchipAllocator& superchip_allocator();

// Dead blocks waiting for a recorded stream before they are reused (tests, diagnostics).
size_t pending_stream_frees();

// Blocks taken from a device's MemoryManager by hand (the weight streamer's arena and staged
// copies) follow a storage's stream rules (Note [Blocks and the streams that allocate them]):
// note_block_allocated() when taken, on the stream that will use it, and free_block() to give
// it back, which waits for that stream once a second stream allocates on the device.
void note_block_allocated(void* ptr, c10::DeviceIndex device) noexcept;
void free_block(void* ptr) noexcept;

// A block of `tier` on `device`, as a DataPtr of device superchip:device.
c10::DataPtr allocate_in_tier(size_t nbytes, Tier tier, c10::DeviceIndex device);

// A block on `device` for a tensor that may live in either tier (Note [Placement] in
// allocator/MemoryManager.cpp): hbm while it has room below `hbm_limit` (0: its capacity),
// else host. Raises torch.OutOfMemoryError naming both tiers when neither can hold it.
c10::DataPtr allocate_placed(size_t nbytes, c10::DeviceIndex device, size_t hbm_limit = 0);

// Weights copied in from the CPU: when `storage` is in hbm and hbm is past its weights
// limit (capacity minus the activation reserve), its bytes move to host before the copy
// overwrites them all (nothing is copied). Called by copy_ for a destination that covers
// its whole storage.
void place_incoming_weights(c10::StorageImpl& storage);

// A parameter made on the device (`with torch.device("superchip")`, `device=` arguments): the
// same limit, but its bytes may hold values already, so they move to host with them. Host
// full: it stays in hbm.
void place_registered_weight(c10::StorageImpl& storage);

// Wraps the memory of an executor storage as a superchip DataPtr on `device`, accounted in
// `hbm`. Raises torch.OutOfMemoryError when the budget cannot hold it.
c10::DataPtr adopt_executor_storage(const c10::Storage& executor_storage, c10::DeviceIndex device);

// Tier of a superchip storage (an empty storage reports hbm, where it would allocate). A
// copy-on-write storage (torch._lazy_clone) reports the tier of the bytes it shares.
Tier storage_tier(const c10::StorageImpl& storage);

// Replaces the bytes of `storage` in place by a copy in `tier` (no-op when already there).
// Every tensor and view over the storage follows. Strong guarantee: on error nothing changed.
void move_storage_to_tier(c10::StorageImpl& storage, Tier tier);
// As move_storage_to_tier(), but false (nothing changed, no error counted) when `tier` has no
// room for it now or a collective holds its bytes: for a caller with a fallback (the weight
// streamer's promotions).
bool try_move_storage_to_tier(c10::StorageImpl& storage, Tier tier);

// Grows or shrinks a superchip storage to nbytes, keeping its tier and its leading bytes.
void resize_storage_bytes(c10::StorageImpl& storage, size_t nbytes);

// An executor kernel ran out of memory (Note [Executor out of memory] in native/Forward.cpp):
// gives back what superchip holds cached where that executor allocates (the CUDA executor:
// hbm of `device`, after the blocks waiting for their streams; the CPU executor: both tiers
// of every device, all host memory). Returns the bytes given back. Never throws.
size_t release_cached_memory_for_executor(c10::DeviceIndex device) noexcept;

// Turns a MemoryManager OutOfTierMemory into torch.OutOfMemoryError (same message).
[[noreturn]] void rethrow_as_torch_oom(const OutOfTierMemory& e);

// The allocator behind pin_memory=True when superchip is the accelerator and the executor is
// the CPU (the CUDA executor uses CUDA's pinned allocator): host memory, device cpu.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* ptr);

}  // namespace superchip
