#include "backend/runtime/WriteWatch.h"

#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend/engine/OffloadEngine.h"

namespace superchip {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // tells a dead entry from a live one
  uint64_t writes = 0;
};

struct Table {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, Entry> entries;
  size_t sweep_at = 64;                 // entries at which watch() drops the dead ones
  std::atomic<size_t> count{0};         // entries.size(), read without the mutex by note_write
};

Table& table() {
  static Table* t = new Table();  // leaked: deleters may run after static destruction
  return *t;
}

}  // namespace

void watch_writes(c10::StorageImpl& storage) {
  // Made and dropped outside the mutex: a reference count that moves may take the GIL (Note
  // [Engine and the GIL] in engine/OffloadEngine.cpp), and the GIL's holder may be waiting for
  // the mutex in note_write().
  c10::weak_intrusive_ptr<c10::StorageImpl> weak(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(&storage));
  std::vector<Entry> dead;
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    auto it = t.entries.find(&storage);
    if (it != t.entries.end()) {
      if (!it->second.storage.expired()) return;
      dead.push_back(std::move(it->second));  // a dead storage's address, reused
      t.entries.erase(it);
    }
    if (t.entries.size() >= t.sweep_at) {
      for (auto e = t.entries.begin(); e != t.entries.end();) {
        if (!e->second.storage.expired()) {
          ++e;
          continue;
        }
        dead.push_back(std::move(e->second));
        e = t.entries.erase(e);
      }
      t.sweep_at = std::max<size_t>(64, 2 * t.entries.size());
    }
    t.entries.emplace(&storage, Entry{std::move(weak), 0});
    t.count.store(t.entries.size(), std::memory_order_relaxed);
  }
}

uint64_t writes_noted(const c10::StorageImpl& storage) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.entries.find(&storage);
  return it == t.entries.end() ? 0 : it->second.writes;
}

void note_write(const c10::StorageImpl* storage) noexcept {
  Table& t = table();
  // Relaxed: a write and the writes_noted() that must see it are ordered by the training
  // thread itself (or by the user's own synchronization between threads), not by this load.
  if (t.count.load(std::memory_order_relaxed) == 0 || OffloadEngine::on_worker()) return;
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.entries.find(storage);
  if (it != t.entries.end()) it->second.writes++;
}

size_t watched_storage_count() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.entries.size();
}

}  // namespace superchip
