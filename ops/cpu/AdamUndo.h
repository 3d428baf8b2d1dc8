// Exact rollback of a speculative Adam/AdamW step (Note [Exact rollback] in AdamUndo.cpp).
// adam_step_recording() runs adam_step() and writes, per element, one byte of codes (2, 3, 2
// and 1 bits for param, exp_avg, exp_avg_sq, param_lowp) plus an exception list for the rare
// elements the codes cannot describe; adam_undo() restores every element bit for bit from the
// stepped arrays, the same gradient and the same hyper-parameters. amsgrad is not supported
// (its running max is not invertible): callers step such groups without speculation.
// Thread-safety: calls on disjoint arrays may run concurrently. n == 0 is a no-op.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/cpu/FusedOptim.h"

namespace superchip::ops {

// One element field that the 2-bit code could not express: its value before the step.
struct UndoException {
  uint32_t index_field;  // element index (within the arrays of the call) << 2 | field
  uint32_t bits;         // the old bits (a bf16/fp16 param_lowp in the low 16 bits)
  int64_t index() const { return index_field >> 2; }
  int field() const { return static_cast<int>(index_field & 3); }  // 0 param, 1 exp_avg, 2 exp_avg_sq, 3 param_lowp
};

// Elements one recording call may cover (the exception entries index them in 30 bits).
constexpr int64_t kMaxUndoElements = int64_t{1} << 30;

// Steps `a` in place exactly as adam_step(h, a, path) does (same bits) and appends what
// adam_undo needs: `codes` must hold a.n bytes; exceptions are appended in index order.
// Throws std::invalid_argument for amsgrad or for the arguments adam_step rejects.
void adam_step_recording(const AdamHyper& h, const AdamArrays& a, SimdPath path, uint8_t* codes,
                         std::vector<UndoException>* exceptions);

// Restores param, exp_avg, exp_avg_sq and param_lowp of `a` to their values before the
// recorded step. `a` must hold the stepped values and the same gradient bits; `h` must be the
// hyper-parameters of that step.
void adam_undo(const AdamHyper& h, const AdamArrays& a, const uint8_t* codes,
               const std::vector<UndoException>& exceptions);

}  // namespace superchip::ops
