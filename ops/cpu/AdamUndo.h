// Exact rollback of a speculative Adam/AdamW step (Note [Exact rollback] in AdamUndo.cpp).
// adam_step_recording() runs adam_step() and writes an undo log: per element a 4-bit code
// (exp_avg and exp_avg_sq: how far the old value is from a prediction made from the stepped
// values, or an escape), plus a byte stream with the residuals the codes do not hold; adam_undo()
// restores every element of param, exp_avg, exp_avg_sq and param_lowp bit for bit from the
// stepped arrays, the same gradient and the same hyper-parameters. Any old value can be
// logged (NaN, infinities, denormals, signed zeros); only the log's size depends on the data.
// amsgrad is not supported (its running max is not invertible): callers step such groups
// without speculation.
// Thread-safety: calls on disjoint arrays and logs may run concurrently. n == 0 is a no-op.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/cpu/FusedOptim.h"

namespace superchip::ops {

// The undo log of one recorded call.
struct AdamUndoLog {
  std::vector<uint8_t> codes;  // (n + 1) / 2 bytes: element i's code in the low nibble when i is even
  std::vector<uint8_t> side;   // the residuals the codes leave out, in element order (varints)
  int64_t n = 0;               // elements the log covers
  int64_t escapes = 0;         // fields whose residual is in `side`

  // Host memory the log holds.
  int64_t bytes() const { return static_cast<int64_t>(codes.capacity() + side.capacity()); }
};

// Steps `a` in place exactly as adam_step(h, a, path) does (the same bits, which every path
// gives; the step runs in the recording's own vectorized loop) and replaces `*log`
// with what adam_undo needs. Throws std::invalid_argument for amsgrad, a null log, or the
// arguments adam_step rejects (nothing is stepped then).
void adam_step_recording(const AdamHyper& h, const AdamArrays& a, SimdPath path, AdamUndoLog* log);

// Restores param, exp_avg, exp_avg_sq and param_lowp of `a` to their values before the
// recorded step. `a` must hold the stepped values and the same gradient bits; `h` must be the
// hyper-parameters of that step. A log that does not match the arrays (size, codes, residual
// stream) throws std::invalid_argument before anything is written.
void adam_undo(const AdamHyper& h, const AdamArrays& a, const AdamUndoLog& log);

}  // namespace superchip::ops
