// WriteWatch: superchip storages whose writes by a user's operators are remembered, for an
// owner that must notice writes the tensor's version counter does not show: a write through
// `p.data` (a tensor of its own, with its own version counter, over the parameter's bytes)
// to a bf16/fp16 parameter the optimizer keeps an fp32 master of (Note [A written parameter
// is its master's new value] in python/superchip/optim.py).
// Noted: forwarded kernels that write an operand (in place, out=), copies into the storage
// and collectives that write it (sccl), from any thread but the engine's worker (the
// optimizer's own writes go past these paths). Not noted: kernels of compiled graphs, which
// write their inputs past superchip's operators. A count per storage, not a flag: each owner
// of a view of it (parameters sharing one flat buffer) compares with the count it saw last.
// Entries hold no reference: a storage that dies leaves its entry until a later watch()
// sweeps it. Thread-safe; note() never throws and costs one load while nothing is watched.
#pragma once

#include <c10/core/StorageImpl.h>

#include <cstdint>

namespace superchip {

// Starts watching `storage` (its count 0); watching it already changes nothing.
void watch_writes(c10::StorageImpl& storage);
// Writes to `storage` noted since it was watched; 0 for a storage not watched.
uint64_t writes_noted(const c10::StorageImpl& storage);
// A write to `storage` began (the forwarding layer).
void note_write(const c10::StorageImpl* storage) noexcept;
// Watched entries, live or not yet swept (tests, diagnostics).
size_t watched_storage_count();

}  // namespace superchip
