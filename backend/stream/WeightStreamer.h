// WeightStreamer: weights that live in `host` are read by kernels from a copy staged in `hbm`
// ahead of their use (DESIGN.md "Adaptive weight offloading": weight-flow).
//
// Contract:
//  - A cache, never a second source of truth. A kernel reads either the host bytes of a weight
//    or a bitwise copy of them made after the last write to them; which one never changes a
//    result. Writes always go to the host bytes (a kernel that writes a weight is given the
//    host bytes; a staged copy of it is dropped).
//  - Streamed: storages marked as weights (floating-point tensors copied in from the CPU as a
//    whole: .to("superchip"), torch.load(map_location=...), load_state_dict; parameters made
//    on the device, marked when a module registers them or an optimizer first steps them
//    (python/superchip/__init__.py); and whole dtype casts of weights
//    outside autocast: model.to("superchip").bfloat16()) that are in `host`
//    when a kernel reads them. Everything else is read in place, as before.
//  - Record, plan, stream (Note [Streaming plan] in WeightStreamer.cpp): the first pass over
//    the weights records the order of their reads (forward, then backward, collapsed) and how
//    much memory the pass's activations and gradients take; the plan is that order, a staging
//    arena reserved in hbm (what hbm has free less that measured peak, at least the two largest
//    consecutive streamed reads) and the prefetch window the arena allows. When hbm has too
//    little free for that least arena, the plan demotes the largest stationary weights to host
//    (applied between operators: apply(), before the next module call or after the optimizer
//    step), so they are streamed too. When hbm is under its weights limit, it promotes
//    streamed weights back to hbm instead (Note [Promotions]); weights the user moved by hand
//    (move_to_tier) are neither demoted nor promoted. Float input batches copied in while passes run are
//    marked too, but never enter the order (Note [Inputs are not weights]). While streaming, each read
//    advances a cursor through the order, stages the next weights of the window ahead of use
//    (a copier thread in emulated mode) and releases staged copies that left the window. The
//    plan is redone when the hbm budget changes, a planned weight dies, a new weight keeps
//    being read, reads stop following the order, or a move it asked for failed. Its figures
//    are measured over one recorded period, wherever in a pass the plan was made (Note [The
//    plan measures between passes]).
//  - Staging memory comes from the `hbm` tier (accounted in its statistics, never past its
//    budget): the arena, once planned, for the plan's weights; single blocks while recording
//    and for weights outside the plan (a batch). When neither can hold a copy, the kernel
//    reads the host bytes in place.
//  - Writes that bypass the forwarding layer (fused optimizer steps, engine jobs, tier moves)
//    call note_written() after they wrote (compiled graphs: before they run, for every input);
//    a copy begun before a write ends is never used.
//  - GIL (Note [Engine and the GIL]): the copier thread touches raw pointers only; staged
//    entries, which hold a strong reference to their weight's storage, are created and
//    destroyed on operator threads, never under the streamer's lock.
//  - Copies run on a side stream (StagingCopier.h): a thread in emulated mode, a CUDA copy
//    stream ordered with the current stream by events on the CUDA executor. Where a copy
//    cannot be ordered with the current stream, kernels read host weights in place (zero-copy
//    over the pinned mapping) and the plan reports mode "in_place".
// Thread-safety: every member may be called from any thread.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace superchip {

struct StreamStats {
  int64_t staged_copies = 0;       // host -> hbm copies made (prefetched or at use)
  int64_t staged_bytes = 0;        // bytes of those copies
  int64_t prefetched = 0;          // copies issued ahead of use
  int64_t hits = 0;                // reads served by a copy staged before the read
  int64_t prefetch_waits = 0;      // of those, reads that waited for the copy to finish
  int64_t staged_at_use = 0;       // reads that had to copy first (no usable prefetch)
  int64_t in_place_reads = 0;      // streamed weights read in place: hbm could not hold a copy
  int64_t invalidated = 0;         // staged copies dropped because their weight was written
  int64_t mispredictions = 0;      // reads that did not follow the planned order
  int64_t plans = 0;               // plans made
  int64_t staging_bytes = 0;       // hbm held by staged copies now
  int64_t staging_peak_bytes = 0;  // max of staging_bytes since the last reset
  double copy_seconds = 0.0;       // time spent copying (copier and at-use)
};

struct StreamPlanEntry {
  const c10::StorageImpl* storage;  // identity only (Python maps it to parameter names)
  size_t nbytes;
  bool streamed;                    // in host now (staged ahead of use), else stationary in hbm
};

struct StreamPlan {
  std::string state;   // "off", "idle" (nothing streamed yet), "recording", "streaming", "unplanned"
  std::string mode;    // "stage" (copy into hbm ahead of use) or "in_place" (kernels read host)
  int64_t version = 0;                // plans made so far; the current one is number `version`
  std::vector<StreamPlanEntry> order;  // weight reads of one pass, in order (a weight may
                                       // appear twice), stationary ones included
  std::vector<StreamPlanEntry> row_reads;  // weights only ever read by rows (embeddings): read
                                           // in place, never staged; streamed = in host
  size_t streamed_bytes = 0;           // distinct bytes of the streamed weights in `order`
  size_t hbm_capacity = 0;             // the budget the plan was made for (0 = unlimited)
  size_t activation_peak_bytes = 0;    // peak growth of both tiers while recording (activations,
                                       // gradients), staging excluded
  size_t staging_budget = 0;           // the staging arena: hbm reserved for staged copies
  int prefetch_depth = 0;              // upcoming reads kept staged from every position of
                                       // the order (the least: more where copies are smaller)
  int64_t demoted = 0;                 // stationary weights this plan moved to host
  int64_t promoted = 0;                // streamed weights this plan moved to hbm
  double copy_bytes_per_s = 0.0;       // measured staging copy rate (0 before any copy)
};

class WeightStreamer {
 public:
  static WeightStreamer& get();

  // Marks `storage` as a weight (see above). Cheap; called by copy_ for whole-storage copies
  // of floating-point tensors from the CPU. `of_model`: known to be a model's (a cast of a
  // weight, a registered or stepped parameter), never a batch (Note [Inputs are not weights]).
  void mark_weight(c10::StorageImpl& storage, bool of_model = false);
  // Whether `storage` is a live weight (marked, see above).
  bool is_weight(const c10::StorageImpl* storage);
  // Whether a plan is being followed and all its weights are alive: training or inference is
  // under way, so a float tensor copied in from the CPU now is a batch, not a model's weight
  // (Note [Batches while streaming] in native/Native.cpp).
  bool following_live_plan();
  // A storage moved to host (move_to_tier): streaming starts if it is a weight.
  void note_moved_to_host(const c10::StorageImpl* storage);
  // The user moved `storage` by hand (superchip.move_to_tier): if it is a weight, no plan
  // moves it again (Note [Promotions] in WeightStreamer.cpp).
  void note_placed_by_hand(const c10::StorageImpl* storage);
  // For a superchip storage a kernel is about to read: a DataPtr (device `executor_device`)
  // over a staged copy, or an empty DataPtr to read in place. Call after the engine's
  // wait_for_storage(). The DataPtr pins the copy until it is released.
  c10::DataPtr read(c10::StorageImpl* storage, c10::Device executor_device);
  // A kernel is about to read a few rows of `storage` (an embedding, index_select) in place:
  // such reads are not staged and not part of the order; while recording they make the
  // weight a preferred demotion (Note [Row reads] in WeightStreamer.cpp).
  void note_rows_read(const c10::StorageImpl* storage);
  // `storage` was (or is about to be) written outside a staged read: drop its staged copy.
  void note_written(const c10::StorageImpl* storage) noexcept;
  // The weight storage behind a DataPtr returned by read(), else nullptr.
  static c10::StorageImpl* source_of(const c10::DataPtr& staged) noexcept;
  // Whether read() may return a staged copy at all (fast path for operators).
  bool active() const noexcept;

  // Raises when SUPERCHIP_STREAM is not understood (superchip's _init, at import).
  static void check_environment();
  // SUPERCHIP_STREAM=0 starts disabled. Disabling drops every staged copy and the plan.
  void set_enabled(bool enabled);

  // Held by every superchip operator (the forwarding layer's AliasSet) and fused optimizer
  // step for as long as it addresses superchip bytes. When a second thread (not the engine's
  // worker) enters one while another thread is inside one, streaming turns itself off for
  // the process, with a warning (Note [One thread runs the operators] in WeightStreamer.cpp).
  class OperatorScope {
   public:
    OperatorScope() noexcept;
    ~OperatorScope();
    OperatorScope(const OperatorScope&) = delete;
    OperatorScope& operator=(const OperatorScope&) = delete;

   private:
    bool counted_ = false;
  };
  bool enabled() const noexcept;
  // No weight read recorded since the plan was last reset: nothing planned, nothing moves.
  bool idle() const noexcept;
  // Applies what the plan decided but an operator could not do: demotes the stationary weights
  // it chose to stream (so the staging arena fits), promotes the streamed weights hbm has room
  // for, and reserves the arena. Returns true when a promotion found no room in hbm now and
  // is to be tried again: call apply() again at the next safe point. Call between operators,
  // from a thread that may hold the GIL (Python's module pre-hook and optimizer step hook do).
  bool apply();
  // Called once per plan that has demotions or promotions, on the operator thread that made it, after the
  // streamer's lock is released: it asks for apply() at the next safe point (the Python layer
  // schedules it before the next module call, so inference-only loops get it too).
  using ApplyRequest = void (*)() noexcept;
  void set_apply_request_hook(ApplyRequest hook);
  // Forgets the plan: the next reads record again.
  void replan();
  // Waits for copies in flight and releases every staged copy not in use; when a weight of
  // the plan died (a deleted model), the plan and its arena go too.
  void release_staging();

  // fork() (Note [Fork] in register/Fork.cpp): waits for the copies in flight and keeps new
  // ones out until after_fork(); the child's copier starts anew.
  void prepare_fork();
  void after_fork(bool child);

  StreamStats stats();
  void reset_stats();
  StreamPlan plan();

 private:
  WeightStreamer();
  struct Impl;
  Impl* impl_;  // leaked with the streamer: the copier thread outlives every static
};

}  // namespace superchip
