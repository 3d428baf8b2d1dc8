// StorageLease: marks a superchip storage as used by asynchronous work (a collective in
// flight) so that nothing replaces its bytes underneath that work. While at least one lease
// on a storage lives, move_storage_to_tier() refuses it with a user error naming `what`.
// A lease for work that writes the bytes (writes=true) tells the weight streamer, when it
// ends, that its staged copies of them are stale (stream/WeightStreamer.h): a copy staged
// while the collective ran is never used after it.
// Invariant: leases(s) == number of live StorageLease objects on s; 0 entries are erased.
// Thread-safety: one process-wide mutex; constructing, moving and destroying leases and
// check_no_lease() may run on any thread. The destructor is noexcept and never takes the GIL.
#pragma once

#include <c10/core/StorageImpl.h>

#include <string>

namespace superchip {

class StorageLease {
 public:
  StorageLease() = default;
  // Leases `storage` for `what` (e.g. "allreduce"); keeps the storage alive while held.
  StorageLease(c10::intrusive_ptr<c10::StorageImpl> storage, std::string what, bool writes = false);
  StorageLease(StorageLease&& other) noexcept;
  StorageLease& operator=(StorageLease&& other) noexcept;
  StorageLease(const StorageLease&) = delete;
  StorageLease& operator=(const StorageLease&) = delete;
  ~StorageLease();
  void release() noexcept;

 private:
  c10::intrusive_ptr<c10::StorageImpl> storage_;
  bool writes_ = false;
};

// Raises a user error when `storage` has a live lease: `action` names what was refused.
void check_no_lease(const c10::StorageImpl& storage, const char* action);
// Whether `storage` has a live lease.
bool storage_has_lease(const c10::StorageImpl& storage);
// Number of storages with a live lease (tests, diagnostics).
size_t leased_storage_count();

}  // namespace superchip
