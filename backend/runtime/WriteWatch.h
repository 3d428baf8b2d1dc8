// WriteWatch: superchip storages whose writes by a user's operators are remembered, for an
// owner that must notice writes the tensor's version counter does not show: a write through
// `p.data` (a tensor of its own, with its own version counter, over the parameter's bytes)
// to a bf16/fp16 parameter the optimizer keeps an fp32 master of (Note [A written parameter
// is its master's new value] in python/superchip/optim.py).
// Noted: forwarded kernels that write an operand (in place, out=) and copies into the
// storage, from the training thread (never the engine's worker: the optimizer's own writes
// go past these paths). Not noted: kernels of compiled graphs, which write their inputs past
// superchip's operators. Entries hold no reference: a storage that dies leaves its entry
// until a later watch() sweeps it. Thread-safe; note() never throws and costs one load while
// nothing is watched.
#pragma once

#include <c10/core/StorageImpl.h>

namespace superchip {

// Starts watching `storage` (nothing noted yet); watching it already changes nothing.
void watch_writes(c10::StorageImpl& storage);
// Whether a write to `storage` was noted since it was watched or last taken; clears it.
// False for a storage not watched.
bool take_written(const c10::StorageImpl& storage);
// A write to `storage` began (the forwarding layer).
void note_write(const c10::StorageImpl* storage) noexcept;
// Watched entries, live or not yet swept (tests, diagnostics).
size_t watched_storage_count();

}  // namespace superchip
