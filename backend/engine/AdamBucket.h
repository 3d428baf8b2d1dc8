// A bucket of Adam/AdamW parameters as the offload engine steps it: its parts (one per param
// group, each with its hyper-parameters), and the speculative life cycle
//   speculate (during backward) -> validate (after step()) -> committed | redone
//                               -> rollback (a reader or zero_grad() before step())
// or, for a probe (the predictor's cheap test while speculation is off), only
//   snapshot (during backward) -> validate: compares, then steps -> probe valid | invalid
// A speculation or probe whose snapshot finds no room (the host tier, or the executor for the
// cast), or whose step finds none to stage an operand, is abandoned: it steps nothing, and validate() runs the plain step (Note [A
// speculation without memory] in AdamBucket.cpp). The snapshots are freed as soon as the
// bucket is validated or rolled back, not when the speculation object goes.
// Every transition runs on the engine worker; the undo log makes rollback exact
// (ops/cpu/AdamUndo.h), so a speculated bucket ends bit for bit where the plain step ends.
// Thread-safety: methods other than status()/undo_bytes()/escapes() run on the worker.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

#include "backend/engine/OffloadEngine.h"
#include "backend/optim/FusedStep.h"

namespace superchip {

// Storages an Adam step reads or writes: parameters, masters, moments (and the gradients).
std::vector<c10::intrusive_ptr<c10::StorageImpl>> adam_storages(const std::vector<AdamPart>& parts,
                                                                 bool with_grads);
// Runs the plain step of every part, all or nothing (the asynchronous step's job body).
void step_adam_parts(const std::vector<AdamPart>& parts);

class AdamSpeculation final : public SpeculationHold {
 public:
  enum Status : int {
    kQueued = 0, kSpeculated = 1, kRolledBack = 2, kCommitted = 3, kRedone = 4,
    kProbeValid = 5, kProbeInvalid = 6, kAbandoned = 7,
  };

  // `cast_grads_to_fp32`: the snapshot is cast to fp32 on the executor before the move
  // (the link-cost model's choice); otherwise it keeps the gradient's dtype and the CPU
  // kernel casts while it steps. A `probe` is never stepped speculatively: validate() only
  // records whether a speculation would have been valid, then runs the plain step.
  AdamSpeculation(int64_t owner, std::vector<AdamPart> parts, bool cast_grads_to_fp32,
                  bool probe = false);
  ~AdamSpeculation() override;

  // Bytes of host-tier memory the live snapshots of every speculation hold (any thread): the
  // engine's admission subtracts them from the tier's allocated bytes to see the training's
  // own use (Note [A speculation without memory]).
  static int64_t live_snapshot_bytes();
  // Bytes the undo logs of speculative steps not yet validated or rolled back hold (any
  // thread): malloc'd memory outside the tiers, which the engine's admission counts too.
  static int64_t live_undo_bytes();  // (with the staging copies kept for the undo)

  // Worker: the bucket's gradients cast-then-moved to host-tier snapshots; kAbandoned (and
  // nothing kept) where there is no memory for them.
  void snapshot();
  // Worker: steps from the snapshots, recording the undo log; kAbandoned (snapshots freed,
  // nothing stepped) where the step finds no memory to stage an operand.
  void step();
  // Worker: undoes the speculative step (exact; allocates nothing: Note [An undo needs no
  // memory] in optim/FusedStep.h). No-op unless speculated.
  void rollback() override;
  // Worker, after step(): commits when `current` grads equal the snapshots bit for bit and the
  // hyper-parameters are unchanged; otherwise rolls back and steps `current`.
  void validate(std::vector<AdamPart> current);

  int64_t owner() const override { return owner_; }
  int status() const { return status_.load(); }
  int64_t undo_bytes() const { return undo_bytes_.load(); }
  int64_t escapes() const { return escapes_.load(); }  // undo log fields in side streams
  int64_t elements() const;
  // Worker seconds spent in snapshot() and step(): what speculating this bucket cost (the
  // engine's budget, Note [Speculation budget] in python/superchip/engine.py, learns from it).
  double seconds() const { return seconds_.load(); }
  const std::vector<AdamPart>& parts() const { return parts_; }

 private:
  // Worker: drops the snapshots (once validated or rolled back, nothing reads them again).
  void release_snapshots();
  // Worker: drops the undo log and the staging (committed, rolled back or abandoned).
  void drop_logs();

  int64_t owner_;
  std::vector<AdamPart> parts_;       // grads replaced by the snapshots after snapshot()
  AdamUndoLogs logs_;                 // of the whole bucket, every part
  std::unique_ptr<AdamStaging> staging_;  // the step's bound operands, for the undo
  bool cast_;
  bool probe_;
  bool snapped_ = false;              // parts_' grads are our snapshots (worker only)
  int64_t snapshot_bytes_ = 0;        // their host-tier bytes, in live_snapshot_bytes()
  int64_t live_undo_bytes_ = 0;       // logs_' and staging_'s bytes, in live_undo_bytes()
  std::atomic<int> status_{kQueued};
  std::atomic<int64_t> undo_bytes_{0};
  std::atomic<int64_t> escapes_{0};
  std::atomic<double> seconds_{0.0};
};

}  // namespace superchip
