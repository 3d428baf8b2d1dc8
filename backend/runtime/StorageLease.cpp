#include "backend/runtime/StorageLease.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>
#include <utility>

#include "backend/stream/WeightStreamer.h"

namespace superchip {
namespace {

struct Entry {
  int count = 0;
  std::string what;  // the most recent holder, for the error message
};

std::mutex& lease_mutex() {
  static std::mutex m;
  return m;
}

std::unordered_map<const c10::StorageImpl*, Entry>& leases() {
  static auto* m = new std::unordered_map<const c10::StorageImpl*, Entry>();  // outlives exit
  return *m;
}

}  // namespace

StorageLease::StorageLease(c10::intrusive_ptr<c10::StorageImpl> storage, std::string what, bool writes)
    : storage_(std::move(storage)), writes_(writes) {
  if (!storage_) return;
  std::lock_guard<std::mutex> g(lease_mutex());
  Entry& e = leases()[storage_.get()];
  ++e.count;
  e.what = std::move(what);
}

StorageLease::StorageLease(StorageLease&& other) noexcept
    : storage_(std::move(other.storage_)), writes_(other.writes_) {}

StorageLease& StorageLease::operator=(StorageLease&& other) noexcept {
  if (this != &other) {
    release();
    storage_ = std::move(other.storage_);
    writes_ = other.writes_;
  }
  return *this;
}

StorageLease::~StorageLease() { release(); }

void StorageLease::release() noexcept {
  if (!storage_) return;
  {
    std::lock_guard<std::mutex> g(lease_mutex());
    auto it = leases().find(storage_.get());
    if (it != leases().end() && --it->second.count <= 0) leases().erase(it);
  }
  // The work's writes are final (a lease ends after them): copies staged meanwhile are stale.
  if (writes_) WeightStreamer::get().note_written(storage_.get());
  storage_.reset();
}

void check_no_lease(const c10::StorageImpl& storage, const char* action) {
  std::string what;
  {
    std::lock_guard<std::mutex> g(lease_mutex());
    auto it = leases().find(&storage);
    if (it == leases().end()) return;
    what = it->second.what;
  }
  TORCH_CHECK(false, action, ": the tensor's storage is in use by a collective in flight (", what,
              "). Wait for it first (work.wait(), or a synchronous call without async_op=True), "
              "then move the tensor.");
}

bool storage_has_lease(const c10::StorageImpl& storage) {
  std::lock_guard<std::mutex> g(lease_mutex());
  return leases().count(&storage) != 0;
}

size_t leased_storage_count() {
  std::lock_guard<std::mutex> g(lease_mutex());
  return leases().size();
}

}  // namespace superchip
