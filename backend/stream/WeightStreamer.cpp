#include "backend/stream/WeightStreamer.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "allocator/TierAllocator.h"
#include "backend/engine/OffloadEngine.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/stream/StagingCopier.h"

// Note [Streaming plan]
// Reads are observed per weight storage, consecutive reads of one storage counting once, so one
// training step reads, e.g., embed, q0, k0, ..., lm_head(=embed when tied), ..., k0, q0 (the
// backward reads the weights again, in reverse). Recording appends reads to a trace until the
// trace ends with the same L reads twice in a row, for an L proposed by a pair of consecutive
// reads (prev, cur) that came back after L reads: those L reads are one period (a step, or a
// forward when only inference runs) and become the order; the plan begins with the third pass.
// Pairs, not single weights, so a tied weight read twice in a pass does not end it; two equal
// stretches, not one recurrence, so activation checkpointing (each layer's forward runs again
// in backward) does not either.
// While streaming, the cursor follows the order; a read that does not match the next
// position is found again by its pair (or, failing that, its first position) and counted as a
// misprediction. The plan is redone (recording again) when:
//  - the hbm budget differs from the one the plan was made for;
//  - a planned weight died (a new model);
//  - a weight outside the order is read in three periods in a row (it persists: a new
//    weight; more when inputs reused for a few passes came before: Note [Inputs reused for a
//    few passes]), or 16 of them in a row with no planned weight among them (a new model);
//  - more than a quarter of the reads of a window (as many reads as the order has) were
//    mispredicted, unless that window is an isolated event (Note [Nested periods]), at most
//    three times in a row (after that it stops planning: "unplanned", copies at use, until it
//    records again: Note [Periods that vary]).
// Budget: staging may use hbm's capacity minus the peak that everything else (stationary
// weights, activations, gradients, optimizer state) reached during recording, minus 1/32 of
// the capacity as a margin. The prefetch depth is the number of upcoming reads whose distinct
// copies fit in half of that budget (the other half holds the copies being released and the
// one in use); copies that leave the window [cursor, cursor + depth] are released at once.
//
// Note [Nested periods]
// Training loops repeat at more than one scale: a WGAN's critic steps 5 times for each step of
// its generator, an RL loop decodes 32 tokens with the policy and then trains it, a DPO step
// runs the reference forward twice and the policy's once. Recording stops at the first
// stretch that repeats (one critic step, one decode forward), so the plan was the inner
// pass; the outer step mispredicted over a quarter of its reads and a new recording found
// the inner pass again, every iteration, forever (a review's WGAN: 4 plans in 5 iterations,
// 480 copies at use against 760 hits). And one irregular step now and then (an evaluation
// every 100 steps, peft's merge_adapter() and its forward) threw away a plan that fits
// every other step, for about two steps of recording without a single prefetch.
// So misses are judged per window of as many reads as the order has, and over the last
// kHorizon windows together:
//  - while at most a quarter of the horizon's reads were mispredicted, the plan stays: an
//    irregular step now and then, or an outer step around a well predicted inner pass,
//    costs its own reads' copies at use and nothing else;
//  - past that, the plan is redone. When some of its windows were predicted well, its order
//    is part of the loop and too short for it: the next recording accepts only periods of at
//    least twice its length (min_period, doubling with each such failure, at most
//    kMaxMinPeriod), which a loop of a fixed shape repeats (any multiple of its period is one
//    too). One wrong from its first window (an outer step came first: two critic steps,
//    then the generator's) is taken for part of the loop when the next recording finds its
//    order again (cycle_signature: its pairs, whichever read it starts at), and that
//    recording goes on for a longer period; otherwise the order changed;
//  - a loop with no longer period (decodes of varying length before each training step)
//    records 4 x min_period reads without finding one: that recording then takes the
//    shortest period again, and its plan is a fallback, which keeps going through bad
//    windows (copies at use where the loop leaves it) until kFallbackBad come in a row,
//    when min_period starts over.
// min_period starts over for a new model too (a planned weight died, a new weight read three
// periods in a row).
//
// Note [Periods that vary]
// Found by review, with MoE models and LayerDrop (every result was bitwise equal to CPU; no
// copy was staged ahead):
//  - An inner loop that reads two weights in turn: transformers' eager MoE experts read each
//    layer's experts as slices of two stacked weights (gate_up_proj[e], down_proj[e]), so a
//    layer's reads alternate between two storages, a period of two. The plan was those two;
//    the next layer's reads, 16 outside the order in a row, were taken for a new model, which
//    also forgot min_period: a new plan every layer, forever (586 plans in 80 steps of a tiny
//    Mixtral, 13,492 reads in place). Such a streak now counts as a failed plan that was part
//    of the loop (outgrown()): min_period doubles, so the inner turns are outgrown in a few
//    plans and the step becomes the period (a new model costs a longer first recording, a
//    multiple of its period, still exact).
//  - Reads that differ from step to step: top-1 routing skips the experts no token chose,
//    LayerDrop skips blocks. No two stretches are equal, so no plan was ever made: recording
//    until 2^20 reads (the trace's cost per read growing with it), then "unplanned" for good,
//    every read in place. So a recording that has four times the proposed period's reads
//    without an exact one (an exact period is found by then) takes a near one: the last
//    stretch of as many reads as a pair's last recurrence proposes (at least 8, and
//    min_period), if it predicts the two stretches before it with at most a quarter of their
//    reads missed (the rule plans are kept by), a short skip ahead (at most an eighth of the
//    stretch: a dropped block) costing nothing; the reads it lacks that both stretches have
//    (a block it dropped) are put in where they came, so the order is the union of the steps.
//    While following, a read that skips ahead within the prefetch window is no miss either:
//    its copy is staged (it is still counted in `mispredictions`).
//  - Planning that stops is not final: "unplanned" records again after kMaxTrace (2^18) reads,
//    then twice as many each time (at most kMaxRetry), and the trace is capped at kMaxTrace.
// Measured on the review's repros (4x the budget, SGD; second half of the steps): eager
// stacked experts 1 plan by step 9, then 635 hits, 81 at use or in place; top-1 over 8
// experts 714 / 105; LayerDrop 0.1 over 12 blocks 513 / 63 (test_weights_placement.py).
// LayerDrop 0.3 with a window of one copy still fails the quarter rule and stops planning.
//
// Note [Rotating reads]
// transformers' eager MoE experts (Mixtral, Qwen-MoE, DeepSeek; GPT-OSS, with its biases, reads
// four) loop over the experts some token chose and read each as slices of the same stacked
// weights: gate_up_proj[e], down_proj[e], then the next expert's, so a layer's reads rotate
// over two storages as many times as it has experts hit, which routing changes every step.
// Every step was another sequence: the plan kept failing (a tiny Mixtral at 4x the budget:
// 9 plans in 30 steps, still recording at the end, every read of the last 15 steps in place).
// So a read of one of the last kMaxRotation reads of the order, when those since it were read
// once each and differ from each other (a b c a), begins a rotation, and the rotation's
// reads, in any order, are not reads of the order until another weight comes: the trace
// reads a layer's experts once, however many there are. The position of the rotation's last
// read keeps the copies of those before it staged (`keeps`: in the window there, in the
// depth's sizing, and prefetched first, as a write in between, an optimizer step, makes them
// stale); a rotation first met while following sets it, and the depth is redone at the wrap.
// Not rotations: a weight read twice in a row before the repeat (the forward's last weight,
// read again by backward: ... c d d c), and a batch (Note [Inputs are not weights]), which
// is not remembered, so an expert loop that reads the model's input still rotates. A rotation
// found across a step's boundary (the backward's last read is the forward's second: b a b)
// costs only that its copy is prefetched one read ahead. Measured (the tiny Mixtral, SGD, the
// last 15 of 30 steps): one plan from step 1; 2,451 hits, 255 copies at use, 0 reads in place,
// 0 mispredictions.
//
// Note [Inputs are not weights]
// Weights are recognised by how they arrive (copied in whole from the CPU), and so is a float
// input batch: x.to("superchip") each step is a new "weight" read once or twice per pass, which
// kept every two stretches of the trace different, so a model with float inputs was never
// planned. A model's weights are on the device before its first pass; a batch arrives while
// passes run. So recording ignores storages marked after it began (the batch of the pass in
// which it began is recorded once, at its start, and does not repeat: harmless), unless 16
// of them come in a row with nothing older (a model moved to the device after recording
// began, say after reads of another model's weights): then recording begins again. Weights
// known to be a model's when marked (a cast of a weight, model.bfloat16(); a parameter a
// module registers or an optimizer steps) start the recording over at once: the cast's own
// read of its source may have begun it, and one older weight among the new ones breaks every
// streak. (Counting a young weight's reads would not do: a mask copied in each step and read
// by every layer is read more often than any weight.) While streaming, a batch is a read
// outside the order seen in one step only (one period, or two when the periods' boundary
// falls between its forward and backward reads), which changes nothing; so is a float
// evaluation batch copied in once and read every few steps (a new recording each time it was
// read in periods two apart left it out again: 5 plans in 30 steps). A weight that comes
// later (a second model) is such a read in every period: three in a row start a new
// recording that includes it. Dead weights' entries are purged with their addresses, which a later batch may
// reuse; a storage marked anew at a dead one's address starts with a clean record.
//
// Note [Inputs reused for a few passes]
// An input copied in once and read for a few passes (inputs_embeds or pixel_values kept for
// several PPO epochs; measured: an MLP 4x the budget, each input used for 4 passes) was read
// in three periods in a row and taken for a new weight: a recording (two periods with no
// prefetch) for every input, 6 plans in 24 passes, 11 copies at use per pass against 1 for
// inputs used once. Nothing at its arrival tells it from a second model's weight (both are
// copied in while passes run), so:
//  - A model's weights come several at a time: when kModelWeights weights outside the order
//    persist (kLateRuns periods in a row), or the one read is known to be a model's
//    (Weight::of_model: a parameter a module registers, or one an optimizer steps), it is
//    taken in at kLateRuns, as before.
//  - A lone one is taken in at late_runs (admit_late), which starts at kLateRuns; when one so
//    taken in dies, it was an input, and the next lone one must be read in twice as many
//    periods in a row as it lived (or as it needed); past kMaxLateRuns lone weights are not
//    taken in any more (kLoneClosed). Inputs reused K times stop being taken in after the
//    first such input dies: 1 more recording, not one per input.
//  - A recording that follows a plan's failure (a planned input died, misses, a new budget,
//    moves that failed) admits what was marked since the last admission only when a model
//    came meanwhile (new_arrivals(): kModelWeights weights marked lately, or half the plan's
//    bytes), or every such recording took the input of that moment in and lost it with the
//    next one. A weight alive kLateLife x late_runs periods after it was marked is not young.
// Measured on a review's scenarios (12-layer MLP 4x the budget, SGD, bitwise equal to CPU
// before and after; plans made once the first inputs are gone): PPO with K = 4, 16, 24 passes
// per input, 6 plans before each, 0, 1, 1 after; K = 100 over 5 inputs, 5 before, 3 after (then
// none: lone inputs closed); inference with an input kept for 24 and 64 calls, 6 and 3 before,
// 0 and 1 after. An input left outside the plan and placed in host is copied at use at each
// read (one small copy a pass, where each new plan cost two passes of weights copied at
// use). Left: tiny models (4-8 weights) whose passes read no input the trace keeps may plan
// a longer period (45-52 reads, not 7-15; as before for inputs copied in each step).
// A frozen second model read between a forward and its backward (a reference model's KL
// term) made the backward's first read, the weight the cursor is at, look like a jump back in
// the order: two periods a pass, the frozen reads in one of two, so they never made a run and
// that model stayed outside the plan (after inputs reused 24 passes: never, in 40 steps), and
// each batch, read in three periods, looked persistent. A read of the cursor's weight after
// reads outside the order is now where the cursor is: one period a pass, the frozen model
// taken in after kLateRuns passes.
//
// Note [Row reads]
// An embedding lookup (or index_select) reads a few rows of its table: staging the whole
// table to read them moves the table's bytes where the kernel needs only tokens x row bytes
// (an 8B Llama's 1 GB embedding, for a few MB of rows). So those kernels read the table in
// place (Access::kReadRows), even in host, and such reads are left out of the order. While
// recording they are noted: a weight only ever read by rows is the first the plan demotes
// when hbm lacks room for the arena (demoting it adds nothing to stage), before the largest
// stationary weights. A weight also read whole (a tied LM head) is in the order as usual;
// its row reads still read in place.
//
// Note [Promotions]
// Where a weight lives is decided when it arrives (Note [Placement]): hbm up to its weights
// limit, then host. What hbm held then may be gone by the first pass: a state dict loaded onto
// the device before the model was moved there, then deleted, left every weight in host, each
// streamed twice a step while hbm stood empty. So the plan also promotes: when hbm between
// passes (its least over the period just recorded: weights, optimizer state, the batch; the
// plan itself is often made mid-pass, with activations and gradients in hbm) is under the
// weights limit, the streamed weights that fit beneath it move back to hbm, as long as the
// arena for those still streamed keeps its least room; when hbm is unlimited (budget 0), every
// streamed weight. Never a weight the
// user placed by hand (superchip.move_to_tier), which the plan does not demote either. Applied
// with the demotions, between operators (apply()); one hbm cannot take now is tried again after
// the engine's queued steps ran (they hold the last step's gradients), then at the next apply()
// (activations of the pass in which the plan was made), up to kApplyTries times; the arena is
// reserved once none is left to try. A move that did not happen in the end (a promotion still
// without room, a demotion host refused) leaves the plan's arena and window sized for a
// placement that is not the weights': the plan is redone from where they are, and those weights
// are "stuck" (no plan moves them), so plans cannot loop on them. What blocked the move may
// go (a tensor freed), so stuck weights are tried again by a new plan after kStuckRetry
// periods, twice as many after each further failure, and at once when the budget changes.
// `promoted` and `demoted` count only the moves made.
//
// Note [The plan measures between passes]
// A plan is made at the read that completes its second equal period, which is where recording
// began: between passes for a new model, but mid-pass, activations at their height, when a
// weight came in while passes ran (resize_token_embeddings: recording began at the new LM
// head's read, the end of a forward). So it reads nothing from that moment: hbm's use between
// passes is its least over the recorded period, the activations' and gradients' peak is the
// swing of both tiers' use over it (a baseline taken when recording began counted the previous
// plan's arena and the activations of that moment: the resized model got a 13 KB arena and
// every read went in place), and staging is left out (g_staging_hbm: live arenas and blocks of
// copies, by the bytes asked for, where the copies' bytes left an arena's unused room counted
// as use; the allocator's rounding of those blocks still counts as use). An
// arena hbm cannot hold when the plan is made is taken at the period's position of least use.
//
// Note [One thread runs the operators]
// The plan is one per process and moves weights between tiers (demotions, promotions) from
// whichever thread reaches a module call, with the weights' bytes copied and their old blocks
// freed; a kernel or fused step of another thread running at that moment writes to the old
// bytes (found by review: two threads each training its own model at 4x the budget ended,
// in a few runs in a hundred, one Adam step off, also with overlap=False). Superchip's
// operators and fused steps count the threads inside them (OperatorScope; the engine's worker
// is not counted: tier moves already wait for its jobs). A second thread inside one while
// another is turns streaming off for the process (weights stay where they are, host ones
// read in place: correct, slower), once, with a message; superchip.set_streaming(True) turns
// it back on at the user's risk. A thread that only reads parameters while training runs
// (p.cpu() from a logger) counts too. A second thread that starts after a plan was made can
// meet one move before its first operator is counted. Threads overlapping while the streamer
// is idle (no weight read recorded yet, so no plan and no move) do not count: transformers 5
// loads a checkpoint with four threads copying onto the device, and from_pretrained(...,
// device_map="superchip") turned streaming off, in 3 runs of 4, for the training after it
// (found by review). Such a thread still inside an operator once the training thread's reads
// have begun is counted at the training thread's next operator, long before a plan (two
// passes later) moves anything.
//
// Note [Staged copies and writes]
// A staged copy is used only when no write to its weight began after the copy was issued.
// Every write path marks the copy stale: a kernel given the storage to write (AliasSet, when it
// aliases it and again when the call ends), engine jobs (after they ran, on the worker), the
// fused optimizer, tier moves and resizes; compiled graphs (Inductor), whose kernels write
// inputs in place, drop the copies of all their inputs before they run (a copy an extern
// kernel inside the graph would stage of a weight the same graph writes later is not caught;
// compiled optimizer steps call no extern kernel on weights). Prefetch skips weights with an
// engine job pending (the step of the previous iteration still running); the read then waits
// for the job (wait_for_storage) and copies at use.

namespace superchip {
namespace {

constexpr size_t kMinBytes = 4096;  // smaller weights are read in place
constexpr size_t kMaxRotation = 4;  // Note [Rotating reads]
constexpr size_t kMaxTrace = size_t{1} << 18;      // Note [Periods that vary]
constexpr size_t kMaxRetry = 16 * kMaxTrace;        // Note [Periods that vary]
constexpr int kMaxReplansInRow = 3;
constexpr size_t kHorizon = 8;                      // Note [Nested periods]
constexpr int kFallbackBad = 8;                     // Note [Nested periods]
constexpr size_t kMaxMinPeriod = size_t{1} << 14;  // Note [Nested periods]
constexpr size_t kYoungStreak = 16;  // Note [Inputs are not weights]
// Note [Inputs reused for a few passes]: periods in a row that take a weight outside the order
// in (late_runs for a lone one), the most a lone one may need before they are not taken in
// (kLoneClosed), what counts as a model's arrival, and young weights' life.
constexpr int kLateRuns = 3;
constexpr int kMaxLateRuns = 64;
constexpr int kLoneClosed = 1 << 30;
constexpr size_t kModelWeights = 4;
constexpr int64_t kLateLife = 4;      // x late_runs periods (at most kMaxLateRuns)
constexpr size_t kMaxLateAdmits = 8;  // lone weights taken in late, watched for their death
constexpr int kApplyTries = 4;       // Note [Promotions]
constexpr int64_t kStuckRetry = 8;   // Note [Promotions]: periods before stuck weights are retried
constexpr int64_t kStuckRetryMax = 1024;

// hbm held for staging (Note [The plan measures between passes]): live arenas, whole, and
// copies outside an arena until their blocks are freed.
std::atomic<int64_t> g_staging_hbm{0};

// ---- the staging arena: one hbm block the plan reserves, carved first-fit ----

class Arena {
 public:
  Arena(void* base, size_t size) : base_(static_cast<char*>(base)), size_(size) {
    free_.emplace(0, size);
    g_staging_hbm.fetch_add(static_cast<int64_t>(size), std::memory_order_relaxed);
  }
  ~Arena() {
    // Uncounted first: a reader in between sees staging as use, the safe side.
    g_staging_hbm.fetch_sub(static_cast<int64_t>(size_), std::memory_order_relaxed);
    free_block(base_);  // after the stream that read it (SuperchipAllocator.h)
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  size_t size() const { return size_; }

  void* allocate(size_t n) {
    n = round(n);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < n) continue;
      const size_t off = it->first;
      const size_t rest = it->second - n;
      free_.erase(it);
      if (rest > 0) free_.emplace(off + n, rest);
      return base_ + off;
    }
    return nullptr;
  }

  void release(void* p, size_t n) noexcept {
    n = round(n);
    size_t off = static_cast<size_t>(static_cast<char*>(p) - base_);
    std::lock_guard<std::mutex> lock(mu_);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + n == next->first) {
      n += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        n += prev->second;
        free_.erase(prev);
      }
    }
    free_.emplace(off, n);
  }

 private:
  static size_t round(size_t n) { return (n + 255) & ~size_t{255}; }
  std::mutex mu_;
  char* base_;
  size_t size_;
  std::map<size_t, size_t> free_;  // offset -> bytes
};

// ---- staged copies ----

struct Entry {
  c10::intrusive_ptr<c10::StorageImpl> source;  // created and released on operator threads
  const void* src_ptr = nullptr;
  size_t nbytes = 0;
  MemoryManager* mm = nullptr;
  std::shared_ptr<Arena> arena;  // the block is in it, or (no arena) a block of mm's hbm
  void* block = nullptr;
  bool stale = false;
  bool prefetched = false;
  std::shared_ptr<StagingCopier::Ticket> ticket;  // the copy issued ahead of use, if any
  StagingCopier* copier = nullptr;

  ~Entry() { release_block(); }

  // Gives the block back (once); `source` stays until the entry dies, on an operator thread.
  void release_block() noexcept {
    if (block == nullptr) return;
    copier->before_release(ticket.get());  // the copy may still be writing the block
    ticket.reset();
    if (arena) {
      arena->release(block, nbytes);
    } else {
      g_staging_hbm.fetch_sub(static_cast<int64_t>(nbytes), std::memory_order_relaxed);
      free_block(block);
    }
    block = nullptr;
  }
};

struct StagedUse {
  std::shared_ptr<Entry> entry;
};

void staged_release(void* ctx) noexcept { delete static_cast<StagedUse*>(ctx); }

struct PairHash {
  size_t operator()(const std::pair<const void*, const void*>& p) const noexcept {
    const auto a = reinterpret_cast<uintptr_t>(p.first);
    const auto b = reinterpret_cast<uintptr_t>(p.second);
    return std::hash<uintptr_t>()(a * 0x9E3779B97F4A7C15ULL ^ (b + (a << 6) + (a >> 2)));
  }
};
using PairKey = std::pair<const void*, const void*>;

// A cyclic sequence of reads' signature, the same whichever read it starts at: the sum of its
// pairs' mixed hashes (Note [Nested periods]).
uint64_t cycle_signature(const c10::StorageImpl* const* reads, size_t n) {
  uint64_t sig = n;
  for (size_t k = 0; k < n; ++k) {
    uint64_t z = PairHash()(PairKey(reads[(k + n - 1) % n], reads[k])) + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;  // splitmix64's finaliser
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    sig += z ^ (z >> 31);
  }
  return sig;
}

enum class State { kIdle, kRecording, kStreaming, kUnplanned };

const char* state_name(State s) {
  switch (s) {
    case State::kIdle:
      return "idle";
    case State::kRecording:
      return "recording";
    case State::kStreaming:
      return "streaming";
    case State::kUnplanned:
      return "unplanned";
  }
  return "?";
}

bool env_enabled() {
  const char* v = std::getenv("SUPERCHIP_STREAM");
  if (v == nullptr || *v == '\0') return true;
  const std::string s(v);
  if (s == "0" || s == "false" || s == "off") return false;
  if (s == "1" || s == "true" || s == "on") return true;
  TORCH_CHECK(false, "SUPERCHIP_STREAM=", s, " is not understood: use 1 (stream weights that live "
              "in host through hbm, the default) or 0 (kernels read them in place).");
}

}  // namespace

struct WeightStreamer::Impl {
  std::mutex mu;
  bool enabled = true;
  std::string env_error;  // SUPERCHIP_STREAM's, raised by check_environment() (at import)
  std::atomic<bool> active{false};
  std::unique_ptr<StagingCopier> copier_;  // created with the first copy (under mu)
  std::atomic<StagingCopier*> created_copier{nullptr};  // copier_, readable without mu (fork)
  StagingCopier* forking = nullptr;  // the copier prepare_fork() quiesced
  std::atomic<bool> apply_wanted{false};  // a plan has demotions apply() has not done
  std::atomic<WeightStreamer::ApplyRequest> apply_hook{nullptr};

  // Weights (identity -> liveness, and when it was marked: Note [Inputs are not weights]).
  struct Weight {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak;
    uint64_t marked;  // value of `marks` that marked it
    bool by_hand = false;  // placed by superchip.move_to_tier: the plan never moves it
    bool stuck = false;    // a move a plan asked for failed: plans leave it where it is for a
                           // while (Note [Promotions])
    bool of_model = false;  // known to be a model's when marked: never young
    int64_t mark_period = 0;  // `periods` when it was marked
  };
  // Marked lately: within kLateLife x late_runs periods (Note [Inputs reused for a few passes]).
  bool marked_lately(const Weight& w) const {
    return periods - w.mark_period <= kLateLife * std::min(late_runs, kMaxLateRuns);
  }
  // Marked since the last admission, lately, and not known to be a model's: a batch, or a weight
  // that has yet to show it persists (Note [Inputs are not weights]).
  bool young(const Weight& w) const { return w.marked > rec_marks && !w.of_model && marked_lately(w); }
  std::unordered_map<const c10::StorageImpl*, Weight> weights;
  size_t purge_at = 1024;
  // Note [Dead batches leave soon]: an entry's weak pointer keeps its dead StorageImpl (a
  // small heap object) allocated until the entry goes. Left for the purge of the whole map
  // (past 1024 entries), a loop copying a fresh float batch to the device per call left one
  // between each pair of its freed batch buffers on the CPU heap: an inference loop of 2 MiB
  // batches grew its RSS by 2 MiB a call up to ~2 GiB (the freed buffers split and unusable
  // until malloc_trim), with superchip's own statistics flat. Every entry waits in
  // `mark_queue` (mark order); each mark checks the next max(8, n/8) of it, at most 64,
  // forgets the dead and sends the live to the back: a batch's entry goes within about 8
  // marks of its death (n/64 past 512 live weights), however many inputs a call copies in (a
  // ring of the last 8 marks missed a batch that lived across 8 other marks: found by review).
  std::deque<std::pair<const c10::StorageImpl*, uint64_t>> mark_queue;  // (storage, its `marked`)
  uint64_t marks = 0;      // weights marked so far
  uint64_t rec_marks = 0;  // `marks` when weights were last admitted (Note [Inputs reused for a few passes])
  bool admit_on_start = true;  // whether a recording from kIdle admits what is marked
  size_t young_streak = 0;  // reads in a row of weights marked since then
  size_t unknown_streak = 0;  // streaming: reads in a row of weights outside the order

  State state = State::kIdle;
  const c10::StorageImpl* last = nullptr;
  // Note [Rotating reads]: the last reads of the order (the last is `last`), and whether each
  // was read twice in a row; the length of the rotation being read (its last reads of the
  // order; 0: none); the weight read last, rotations included.
  std::array<const c10::StorageImpl*, kMaxRotation> read_ring{};
  std::array<bool, kMaxRotation> recent_twice{};
  size_t recent_n = 0;
  size_t rotation = 0;
  const c10::StorageImpl* actual = nullptr;

  void forget_reads() {
    last = nullptr;
    recent_n = 0;
    rotation = 0;
    actual = nullptr;
  }

  // Recording.
  std::vector<const c10::StorageImpl*> trace;
  std::vector<size_t> trace_bytes;
  std::vector<size_t> trace_hbm;   // hbm allocated at each read, staging excluded
  std::vector<size_t> trace_both;  // both tiers' allocated bytes at each read, staging excluded
  std::vector<uint8_t> trace_keeps;  // reads before it read again at it (Note [Rotating reads])
  std::unordered_map<PairKey, std::vector<size_t>, PairHash> trace_pairs;  // -> positions of the 2nd

  // The plan.
  struct Item {
    const c10::StorageImpl* s;
    c10::weak_intrusive_ptr<c10::StorageImpl> weak;
    size_t nbytes;
    size_t keeps = 0;  // reads before it read again at it: kept staged (Note [Rotating reads])
  };
  std::vector<Item> order;
  std::unordered_map<PairKey, size_t, PairHash> pairs;
  std::unordered_map<const c10::StorageImpl*, size_t> first;
  size_t cursor = 0;
  int depth = 0;            // the least of reach (reported)
  std::vector<int> reach;   // per position of the order: upcoming reads kept staged from there
  bool reach_stale = false; // a position learned `keeps` while following: redone at the wrap
  std::unordered_set<const c10::StorageImpl*> streamed;  // the plan's weights staged (in host)
  size_t streamed_bytes = 0;
  size_t staging_budget = 0;
  size_t arena_need_bytes = 0;  // room for all the streamed weights' copies at once
  size_t plan_capacity = 0;
  size_t activation_peak = 0;
  size_t low_pos = 0;       // the position of the order at which hbm held the least
  std::shared_ptr<Arena> arena;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> demote;  // applied by apply()
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> promote;  // applied by apply()
  int64_t demoted = 0;
  int64_t promoted = 0;
  int apply_tries = 0;  // apply() calls that found promotions hbm had no room for yet
  size_t stuck_capacity = 0;  // the budget of the plan whose moves failed (Weight::stuck)
  int64_t stuck_backoff = 0;  // periods a plan keeps stuck weights where they are (0: none yet)
  int64_t stuck_retry_at = -1;  // the period of this plan at which they are tried again
  int64_t version = 0;
  int64_t period = 0;  // periods completed while streaming
  size_t period_reads = 0;
  size_t period_misses = 0;
  int replans_in_row = 0;
  // Note [Nested periods].
  size_t min_period = 0;      // the shortest period a recording takes (but a fallback's)
  bool fallback_plan = false;  // made from a recording that found no period of min_period
  uint64_t failed_signature = 0;  // cycle_signature of the last plan its misses ended, or 0
  std::array<std::pair<size_t, size_t>, kHorizon> recent{};  // the last windows: reads, misses
  size_t windows = 0;         // judged windows of this plan
  size_t good_windows = 0;    // of those, with at most a quarter mispredicted
  int bad_windows = 0;        // judged windows in a row with more
  // Note [Periods that vary].
  size_t approx_next = 0;        // the trace length at which a near period is looked for next
  size_t unplanned_reads = 0;    // reads since planning stopped
  size_t unplanned_retry = kMaxTrace;  // reads after which it records again
  // A weight outside the order: the last period it was read in, and in how many in a row.
  struct Unknown {
    int64_t period;
    int run;
  };
  std::unordered_map<const c10::StorageImpl*, Unknown> unknown_seen;
  // Note [Inputs reused for a few passes]: periods in a row that take a lone weight outside the
  // order in (kLoneClosed: never); the lone weights taken in so (and when they were marked).
  int late_runs = kLateRuns;
  int64_t periods = 0;  // periods completed while streaming, all plans
  struct LateAdmit {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak;
    int64_t marked_at;  // `periods` when it was marked
  };
  std::vector<LateAdmit> late_admits;
  std::unordered_set<const c10::StorageImpl*> rows_read;  // read by rows while recording (kept
                                                          // while streaming)
  std::vector<Item> row_only;  // of those, the plan's weights never read whole

  std::unordered_map<const c10::StorageImpl*, std::shared_ptr<Entry>> staged;
  std::vector<std::shared_ptr<Entry>> graveyard;  // released on an operator thread
  StreamStats st;
  double seconds_at_reset = 0.0;  // the copier's measured time and bytes at reset_stats()
  double bytes_at_reset = 0.0;

  // Weights of one device are staged: the first a staged read finds (one copier and one arena;
  // weights on another device of this process are read in place).
  c10::DeviceIndex device = -1;
  c10::DeviceIndex staging_device() { return device >= 0 ? device : current_device(); }
  MemoryManager& mm() { return memory(staging_device()); }

  StagingCopier& copier() {
    if (!copier_) {
      copier_ = make_staging_copier(mm(), staging_device());
      created_copier.store(copier_.get(), std::memory_order_release);
    }
    return *copier_;
  }
  double copy_seconds() const { return copier_ ? copier_->seconds() - seconds_at_reset : 0.0; }
  double copy_bytes() const { return copier_ ? copier_->measured_bytes() - bytes_at_reset : 0.0; }

  size_t hbm_capacity() { return static_cast<size_t>(mm().stats(Tier::kHbm).capacity_bytes); }

  // What the plans learned of the loop's shape goes (Note [Nested periods]): a new model.
  void forget_loop() {
    min_period = 0;
    failed_signature = 0;
  }

  void clear_trace() {
    trace.clear();
    trace_bytes.clear();
    trace_hbm.clear();
    trace_both.clear();
    trace_keeps.clear();
    trace_pairs.clear();
  }

  // `admit`: the weights marked so far may be recorded (a new model, a weight that persists),
  // or only those admitted before (a plan that died or failed: Note [Inputs reused for a few
  // passes]).
  void start_recording(bool admit = true) {
    state = State::kRecording;
    clear_trace();
    if (admit) rec_marks = marks;
    admit_on_start = admit;  // kIdle, set right after this, keeps it
    approx_next = 0;
    young_streak = 0;
    unknown_streak = 0;
    arena.reset();  // freed when its last staged copy goes
    demote.clear();  // the plan's moves not applied yet go with it
    promote.clear();
    order.clear();
    pairs.clear();
    first.clear();
    unknown_seen.clear();
    rows_read.clear();
    row_only.clear();
    depth = 0;
    reach.clear();
    reach_stale = false;
    streamed.clear();
  }

  static size_t staging_hbm() {
    return static_cast<size_t>(std::max<int64_t>(g_staging_hbm.load(std::memory_order_relaxed), 0));
  }

  size_t both_tiers_allocated() {
    MemoryManager& m = mm();
    const auto total = static_cast<size_t>(m.stats(Tier::kHbm).allocated_bytes + m.stats(Tier::kHost).allocated_bytes);
    const size_t staging = staging_hbm();
    return total > staging ? total - staging : 0;
  }

  // Operator threads only (it may free blocks).
  void allocate_arena() {
    if (arena || staging_budget == 0) return;
    void* base = mm().try_allocate(staging_budget, Tier::kHbm);
    size_t droppable = 0;
    size_t free = 0;
    if (base == nullptr) {
      for (const auto& kv : staged) {
        if (!kv.second->arena && kv.second.use_count() == 1) droppable += kv.second->nbytes;
      }
      const TierStats hbm = mm().stats(Tier::kHbm);
      const auto used = static_cast<size_t>(std::max<int64_t>(hbm.allocated_bytes, 0));
      const auto cap = static_cast<size_t>(hbm.capacity_bytes);
      free = cap > used ? cap - used : 0;
    }
    if (base == nullptr && droppable > 0 && free + droppable >= staging_budget) {
      // Copies staged at use while there was no arena may hold its room: they go (prefetch
      // stages them again, in the arena), when that can make the room.
      bool dropped = false;
      for (auto it = staged.begin(); it != staged.end();) {
        if (!it->second->arena && it->second.use_count() == 1) {
          it->second->release_block();
          drop(it->second);
          it = staged.erase(it);
          dropped = true;
        } else {
          ++it;
        }
      }
      if (dropped) base = mm().try_allocate(staging_budget, Tier::kHbm);
    }
    if (base == nullptr) {
      // The allocator rounds the arena's block up (Note [Size rounding and reuse]: to 128 KiB
      // past 1 MiB), past the plan's margin where hbm is small: the arena was never taken, and
      // every copy took a block of its own, remapped under the budget (found by review: a
      // GPT-2 decoding at 1/4 of its weights, 512 page faults a token, 0.39 of all-in-hbm's
      // tokens/s; at 0.30 and 0.40 of the weights the rounding fitted). Then the budget rounded
      // down, its own rounding, while it holds the largest streamed read: the prefetch window
      // is sized for it (compute_reach).
      const size_t granularity = staging_budget >= (size_t{1} << 20) ? kLargeGranularity : kSmallGranularity;
      const size_t smaller = staging_budget / granularity * granularity;
      size_t largest = 0;
      for (const Item& it : order) {
        if (streamed.count(it.s)) largest = std::max(largest, it.nbytes + 256);
      }
      if (smaller < staging_budget && smaller >= largest && largest > 0) {
        base = mm().try_allocate(smaller, Tier::kHbm);
        if (base != nullptr) {
          staging_budget = smaller;
          compute_reach();
        }
      }
    }
    if (base != nullptr) {
      note_block_allocated(base, staging_device());
      arena = std::make_shared<Arena>(base, staging_budget);
    }
  }

  size_t hbm_allocated() {
    const auto total = static_cast<size_t>(mm().stats(Tier::kHbm).allocated_bytes);
    const size_t staging = staging_hbm();
    return total > staging ? total - staging : 0;
  }

  // Whether plans leave `s` where it is: placed by hand, or a move of it failed.
  bool unmovable(const c10::StorageImpl* s) const {
    auto w = weights.find(s);
    return w != weights.end() && (w->second.by_hand || w->second.stuck);
  }

  // The arena the streamed weights of `order` need: `need`, room for all of their copies at
  // once; `least`, for the largest two consecutive reads (the smallest useful arena).
  struct ArenaNeed {
    size_t need = 0;
    size_t least = 0;
    size_t streamed_bytes = 0;
  };
  ArenaNeed arena_need(const std::unordered_set<const c10::StorageImpl*>& streamed) {
    ArenaNeed a;
    for (size_t k = 0; k < order.size(); ++k) {
      const Item& it = order[k];
      if (streamed.count(it.s) && first[it.s] == k) {
        a.need += it.nbytes + 256;
        a.streamed_bytes += it.nbytes;
      }
      const Item& b = order[(k + 1) % order.size()];
      size_t bytes = streamed.count(it.s) ? it.nbytes + 256 : 0;
      if (b.s != it.s && streamed.count(b.s)) bytes += b.nbytes + 256;
      a.least = std::max(a.least, bytes);
    }
    return a;
  }

  // Promotions (Note [Promotions]): streamed weights the plan moves back to hbm, as
  // `.to("superchip")` would place them beside what hbm holds between passes (`low`): under
  // the weights limit, leaving `free_low` room for at least the arena of the weights still
  // streamed. Those read most often in a pass first (a tied weight), then the largest. Returns
  // the arena need of what stays streamed; `streamed` loses the promoted weights and
  // `free_low` their bytes.
  ArenaNeed plan_promotions(std::unordered_set<const c10::StorageImpl*>& streamed, size_t low,
                            size_t& free_low, ArenaNeed a) {
    const size_t limit = mm().weights_limit();  // 0: hbm is unlimited
    if (limit != 0 && limit <= low) return a;
    const size_t room = limit == 0 ? SIZE_MAX : limit - low;
    std::unordered_map<const c10::StorageImpl*, int> reads;
    for (const Item& it : order) reads[it.s]++;
    std::vector<const Item*> cands;
    for (size_t k = 0; k < order.size(); ++k) {
      const Item& it = order[k];
      if (streamed.count(it.s) && first[it.s] == k && !unmovable(it.s) && !it.weak.expired()) {
        cands.push_back(&it);
      }
    }
    std::sort(cands.begin(), cands.end(), [&](const Item* x, const Item* y) {
      return reads[x->s] != reads[y->s] ? reads[x->s] > reads[y->s] : x->nbytes > y->nbytes;
    });
    size_t taken = 0;
    for (const Item* c : cands) {
      if (taken + c->nbytes > room || taken + c->nbytes > free_low) continue;
      streamed.erase(c->s);
      const ArenaNeed left = arena_need(streamed);
      if (left.need > 0 && taken + c->nbytes + left.least > free_low) {
        streamed.insert(c->s);
        continue;
      }
      taken += c->nbytes;
      promote.push_back(c->weak);
      a = left;
    }
    free_low -= taken;
    return a;
  }

  // The plan of the period trace[from, end) (its reads, or `merged`: positions of the trace,
  // Note [Periods that vary]).
  void make_plan(size_t from, const std::vector<size_t>* merged = nullptr) {
    order.clear();
    pairs.clear();
    first.clear();
    std::vector<size_t> positions;
    if (merged == nullptr) {
      for (size_t i = from; i < trace.size(); ++i) positions.push_back(i);
      merged = &positions;
    }
    for (size_t i : *merged) {
      auto w = weights.find(trace[i]);
      c10::weak_intrusive_ptr<c10::StorageImpl> weak =
          w != weights.end() ? w->second.weak : c10::weak_intrusive_ptr<c10::StorageImpl>(
                                               c10::intrusive_ptr<c10::StorageImpl>());
      order.push_back({trace[i], std::move(weak), trace_bytes[i], trace_keeps[i]});
    }
    for (size_t k = 0; k < order.size(); ++k) {
      const c10::StorageImpl* prev = order[(k + order.size() - 1) % order.size()].s;
      pairs.emplace(PairKey(prev, order[k].s), k);
      first.emplace(order[k].s, k);
    }
    plan_capacity = hbm_capacity();
    bool any_stuck = false;
    for (auto& w : weights) {
      if (plan_capacity != stuck_capacity) w.second.stuck = false;  // a new budget: they may move now
      any_stuck |= w.second.stuck && !w.second.weak.expired();
    }
    if (!any_stuck) stuck_backoff = 0;
    stuck_retry_at = any_stuck ? stuck_backoff : -1;
    // Note [The plan measures between passes]: what hbm holds between passes is its least over
    // the period (this read, the period's first again, included), and what activations and
    // gradients take is the swing of both tiers over it.
    size_t low = hbm_allocated();
    size_t both_low = both_tiers_allocated();
    size_t both_high = both_low;
    low_pos = 0;
    for (size_t i = from; i < trace_hbm.size(); ++i) {
      if (trace_hbm[i] < low) {
        low = trace_hbm[i];
        low_pos = i - from;
      }
      both_low = std::min(both_low, trace_both[i]);
      both_high = std::max(both_high, trace_both[i]);
    }
    activation_peak = both_high - both_low;
    arena.reset();
    demote.clear();
    promote.clear();
    // Streamed: the weights in host. Stationary: those in hbm; while hbm has too little free
    // room for the smallest useful staging (the two largest consecutive streamed reads), the
    // largest stationary weights are demoted to host (at the next safe point: apply()).
    streamed.clear();
    std::vector<const Item*> stationary;
    {
      std::unordered_set<const c10::StorageImpl*> seen;
      for (const Item& it : order) {
        if (!seen.insert(it.s).second) continue;
        if (in_host(it.s)) streamed.insert(it.s);
        else stationary.push_back(&it);
      }
    }
    std::sort(stationary.begin(), stationary.end(),
              [](const Item* a, const Item* b) { return a->nbytes > b->nbytes; });
    // Note [Row reads]: weights only read by rows, in hbm, are demoted first (largest first).
    row_only.clear();
    for (const c10::StorageImpl* r : rows_read) {
      auto w = weights.find(r);
      if (first.count(r) || w == weights.end() || w->second.weak.expired()) continue;
      row_only.push_back({r, w->second.weak, r->nbytes()});
    }
    std::sort(row_only.begin(), row_only.end(), [](const Item& a, const Item& b) { return a.nbytes > b.nbytes; });
    std::vector<const Item*> candidates;
    for (const Item& r : row_only) {
      if (!in_host(r.s) && !unmovable(r.s)) candidates.push_back(&r);
    }
    const size_t rows_first = candidates.size();
    for (const Item* it : stationary) {
      if (!unmovable(it->s)) candidates.push_back(it);
    }
    const size_t margin = plan_capacity / 32;
    size_t freed = 0;
    size_t next_demote = 0;
    size_t free_between = 0;
    ArenaNeed a;
    for (;;) {
      a = arena_need(streamed);
      if (plan_capacity == 0) break;
      const size_t avail = plan_capacity + freed;
      free_between = avail > low + margin ? avail - low - margin : 0;
      if (free_between >= a.least || next_demote == candidates.size()) break;
      const bool row_read = next_demote < rows_first;  // read in place: nothing to stage
      const Item* d = candidates[next_demote++];
      if (!row_read) streamed.insert(d->s);
      demote.push_back(d->weak);
      freed += d->nbytes;
    }
    if (demote.empty()) {
      // The period just recorded begins after a whole period of reads (an optimizer's state,
      // made by the first step, is in `low`). An unlimited hbm takes every streamed weight.
      size_t free_low = plan_capacity == 0 ? SIZE_MAX : free_between;
      a = plan_promotions(streamed, low, free_low, a);
      if (plan_capacity > 0) free_between = free_low;
    }
    streamed_bytes = a.streamed_bytes;
    if (plan_capacity == 0) {
      staging_budget = a.need;
    } else {
      // Room for the activations' measured peak first, then for staging, at least `least`.
      const size_t want = free_between > activation_peak ? free_between - activation_peak : 0;
      staging_budget = std::min(std::min(std::max(want, a.least), a.need), free_between);
    }
    demoted = static_cast<int64_t>(demote.size());
    promoted = static_cast<int64_t>(promote.size());
    apply_tries = 0;
    if (demote.empty() && promote.empty()) allocate_arena();
    else apply_wanted.store(true, std::memory_order_relaxed);
    arena_need_bytes = a.need;
    compute_reach();
    version++;
    st.plans++;
    unplanned_retry = kMaxTrace;
    period = 0;
    period_reads = 0;
    period_misses = 0;
    windows = 0;
    good_windows = 0;
    bad_windows = 0;
    clear_trace();
    state = State::kStreaming;
  }

  // Depth: upcoming reads whose distinct streamed copies fit in the arena with the one in use
  // (and those before it read again there: Note [Rotating reads]). Per position: one large
  // pair that does not fit (an MLP's last weight, then the LM head) must not stop
  // prefetching everywhere else. Windows never shrink from one read to the next (what fitted
  // from c fits from c + 1), so a prefetched copy stays until its read.
  void compute_reach() {
    reach_stale = false;
    reach.assign(order.size(), static_cast<int>(order.size()) - 1);
    if (arena_need_bytes > staging_budget) {
      std::unordered_set<const c10::StorageImpl*> window;
      for (size_t start = 0; start < order.size(); ++start) {
        window.clear();
        size_t bytes = 0;
        for (size_t k = 1; k <= order[start].keeps; ++k) {
          const Item& p = order[(start + order.size() - k) % order.size()];
          if (streamed.count(p.s) && window.insert(p.s).second) bytes += p.nbytes + 256;
        }
        int d = 0;
        for (size_t k = 0; k < order.size(); ++k) {
          const Item& it = order[(start + k) % order.size()];
          if (streamed.count(it.s) && window.insert(it.s).second) bytes += it.nbytes + 256;
          if (bytes > staging_budget) break;
          d = static_cast<int>(k);
        }
        reach[start] = d;
      }
    }
    depth = reach.empty() ? 0 : *std::min_element(reach.begin(), reach.end());
  }

  // Note [Rotating reads]: whether `s` continues the rotation being read, or begins one (it
  // is among the last kMaxRotation reads of the order, which were read once each since and
  // differ from each other). Not a read of the order then.
  bool rotates(const c10::StorageImpl* s) {
    if (rotation > 0) {
      for (size_t j = 0; j < rotation; ++j) {
        if (read_ring[recent_n - rotation + j] == s) return true;
      }
      rotation = 0;
      return false;
    }
    for (size_t k = 2; k <= recent_n; ++k) {
      if (read_ring[recent_n - k] != s) continue;
      for (size_t j = recent_n - k; j < recent_n; ++j) {
        if (recent_twice[j]) return false;
        for (size_t i = j + 1; i < recent_n; ++i) {
          if (read_ring[i] == read_ring[j]) return false;
        }
      }
      rotation = k;
      // The copies of the rotation's reads before the last are kept where the last is read.
      if (state == State::kRecording) {
        if (!trace_keeps.empty() && trace.back() == last) {
          trace_keeps.back() = static_cast<uint8_t>(std::max<size_t>(trace_keeps.back(), k - 1));
        }
      } else if (state == State::kStreaming && !order.empty() && order[cursor].s == last &&
                 order[cursor].keeps < k - 1) {
        order[cursor].keeps = k - 1;
        reach_stale = true;  // the window at the cursor holds more copies: redone at the wrap
      }
      return true;
    }
    return false;
  }

  // A read of the order: the last kMaxRotation are remembered.
  void remember(const c10::StorageImpl* s) {
    if (recent_n == kMaxRotation) {
      std::copy(read_ring.begin() + 1, read_ring.end(), read_ring.begin());
      std::copy(recent_twice.begin() + 1, recent_twice.end(), recent_twice.begin());
      recent_n--;
    }
    read_ring[recent_n] = s;
    recent_twice[recent_n] = false;
    recent_n++;
    last = s;
  }

  // Records one (collapsed) read; may turn the trace into a plan.
  void record(const c10::StorageImpl* prev, const c10::StorageImpl* s, size_t nbytes) {
    // Note [Inputs are not weights]: marked since recording began, so not part of the order,
    // unless nothing else is read (a model that came after recording began).
    auto w = weights.find(s);
    if (w != weights.end() && young(w->second)) {
      if (++young_streak < kYoungStreak) return;
      forget_loop();
      start_recording();  // now none of them is young
    }
    young_streak = 0;
    if (!trace.empty()) prev = trace.back();
    if (prev != nullptr) {
      auto it = trace_pairs.find(PairKey(prev, s));
      if (it != trace_pairs.end()) {
        // Each earlier position of this pair proposes a period L; it is one when the last two
        // stretches of L reads are equal (Note [Streaming plan]), and L is at least
        // min_period, unless 4 x min_period reads found none (Note [Nested periods]).
        const size_t n = trace.size();
        const bool fallback = min_period > 0 && n > 4 * min_period;
        for (auto pos = it->second.rbegin(); pos != it->second.rend(); ++pos) {
          const size_t len = n - *pos;
          if (len < (fallback ? 2 : std::max<size_t>(2, min_period))) continue;
          if (2 * len > n) break;  // positions only get earlier
          if (std::equal(trace.begin() + static_cast<std::ptrdiff_t>(n - len), trace.end(),
                         trace.begin() + static_cast<std::ptrdiff_t>(n - 2 * len))) {
            if (!fallback && failed_signature != 0 &&
                cycle_signature(trace.data() + (n - len), len) == failed_signature) {
              // The order of the plan that just failed, found again: the loop is longer.
              min_period = std::min(kMaxMinPeriod, std::max(2 * min_period, 2 * len));
              continue;
            }
            fallback_plan = fallback;
            make_plan(n - len);
            cursor = 0;  // order[0] is s
            return;
          }
        }
        if (n >= approx_next && near_period(it->second, n)) return;
      }
    }
    trace.push_back(s);
    trace_keeps.push_back(0);
    trace_bytes.push_back(nbytes);
    trace_hbm.push_back(hbm_allocated());
    trace_both.push_back(both_tiers_allocated());
    if (prev != nullptr) trace_pairs[PairKey(prev, s)].push_back(trace.size() - 1);
    if (trace.size() >= kMaxTrace) {
      stop_planning();
      clear_trace();
    }
  }

  // Note [Periods that vary]: no stretch of the trace repeats, but the last one, of as many
  // reads as this pair's last recurrence proposes (at least 8 and min_period), would have
  // predicted the two before it with at most a quarter of their reads mispredicted. Its plan
  // is that stretch with the reads it lacks (a layer it skipped) inserted where they came.
  bool near_period(const std::vector<size_t>& positions, size_t n) {
    const size_t least = std::max<size_t>(8, min_period);
    size_t len = 0;
    for (auto pos = positions.rbegin(); pos != positions.rend(); ++pos) {
      if (n - *pos >= least) {
        len = n - *pos;
        break;
      }
    }
    // Exact periods first: a stretch that repeats is found by the second pass after the one
    // recording began in (whose first reads, a batch, can differ), a near one from the third.
    if (len == 0 || 4 * len > n) return false;
    approx_next = n + std::max<size_t>(8, len / 8);  // at most one look per eighth of a period
    const size_t from = n - len;
    std::unordered_map<const c10::StorageImpl*, std::vector<size_t>> at;  // -> offsets in it
    for (size_t k = 0; k < len; ++k) at[trace[from + k]].push_back(k);
    // Reads it lacks: (offset followed before, trace position); inserted when read in both
    // stretches (a batch of the first pass recorded, read once, is not).
    std::vector<std::pair<size_t, size_t>> lacked;
    std::unordered_map<const c10::StorageImpl*, int> lacked_in;  // bit k: read in stretch k
    constexpr size_t kNone = SIZE_MAX;
    size_t cur = kNone;  // offset of the last read followed
    size_t misses = 0;
    for (size_t i = from - 2 * len; i < from; ++i) {
      const c10::StorageImpl* r = trace[i];
      auto f = at.find(r);
      if (f == at.end()) {
        misses++;
        lacked_in[r] |= i < from - len ? 1 : 2;
        if (cur != kNone) lacked.emplace_back(cur, i);
        continue;
      }
      if (cur != kNone && trace[from + (cur + 1) % len] == r) {
        cur = (cur + 1) % len;
        continue;
      }
      const std::vector<size_t>& offsets = f->second;  // its next read after `cur`, cyclically
      auto up = cur == kNone ? offsets.end() : std::upper_bound(offsets.begin(), offsets.end(), cur);
      const size_t to = up != offsets.end() ? *up : offsets.front();
      // A short skip ahead (a layer this stretch has and that one dropped) is no miss.
      if (cur != kNone && (to + len - cur) % len > std::max<size_t>(2, len / 8)) misses++;
      cur = to;
    }
    if (misses * 4 > 2 * len) return false;
    std::vector<std::vector<size_t>> inserted(len);  // trace positions read after offset k
    std::set<std::pair<size_t, const c10::StorageImpl*>> inserted_at;
    for (const auto& [k, i] : lacked) {
      auto w = weights.find(trace[i]);
      if (lacked_in[trace[i]] != 3 || w == weights.end() || w->second.weak.expired()) continue;
      if (inserted_at.emplace(k, trace[i]).second) inserted[k].push_back(i);
    }
    std::vector<size_t> merged;
    for (size_t k = 0; k < len; ++k) {
      merged.push_back(from + k);
      merged.insert(merged.end(), inserted[k].begin(), inserted[k].end());
    }
    fallback_plan = false;
    make_plan(from, &merged);
    cursor = 0;  // order[0] is the read being recorded
    return true;
  }

  // Judges the window of reads just followed (Note [Nested periods]). Returns false when the
  // plan was dropped.
  bool judge_window() {
    const size_t reads = period_reads;
    const size_t misses = period_misses;
    period_reads = 0;
    period_misses = 0;
    const bool bad = misses * 4 > reads;
    if (misses == 0) replans_in_row = 0;
    bad_windows = bad ? bad_windows + 1 : 0;
    good_windows += bad ? 0 : 1;
    recent[windows % kHorizon] = {reads, misses};
    windows++;
    if (fallback_plan) {
      if (bad_windows < kFallbackBad) return true;
      forget_loop();  // kFallbackBad in a row: the loop changed
    } else {
      size_t r = 0;
      size_t m = 0;
      for (size_t k = 0; k < std::min<size_t>(windows, kHorizon); ++k) {
        r += recent[k].first;
        m += recent[k].second;
      }
      if (m * 4 <= r) return true;  // the last kHorizon windows were followed well enough
      // A plan that predicted some windows well is part of the loop: a longer period has it all.
      // One wrong from its start is, if the next recording finds its order again.
      outgrown(good_windows > 0);
    }
    replan_or_give_up();
    return false;
  }

  // The plan's order is a part of the loop (Note [Nested periods]): the next recording takes
  // longer periods (`longer`), or those of another order than this one.
  void outgrown(bool longer) {
    if (longer) min_period = std::min(kMaxMinPeriod, std::max(2 * min_period, 2 * order.size()));
    std::vector<const c10::StorageImpl*> cycle;
    cycle.reserve(order.size());
    for (const Item& it : order) cycle.push_back(it.s);
    failed_signature = cycle_signature(cycle.data(), cycle.size());
  }

  // Note [Periods that vary]: no plan; reads are staged at use. Recording starts again after
  // unplanned_retry reads.
  void stop_planning() {
    state = State::kUnplanned;
    unplanned_reads = 0;
  }

  void replan_or_give_up() {
    if (++replans_in_row > kMaxReplansInRow) {
      stop_planning();
      order.clear();
      pairs.clear();
      first.clear();
      depth = 0;
      reach.clear();
    } else {
      record_again();
    }
  }

  // Note [Inputs reused for a few passes]: `s`, a lone weight read outside the order in
  // late_runs periods in a row, is taken in by the recording that begins now.
  void admit_late(const c10::StorageImpl* s) {
    auto w = weights.find(s);
    if (w == weights.end()) return;
    if (late_admits.size() == kMaxLateAdmits) late_admits.erase(late_admits.begin());
    late_admits.push_back({w->second.weak, w->second.mark_period});
  }

  // Note [Inputs reused for a few passes]: a lone weight taken in late that died was an input:
  // the next must be read in twice as many periods in a row as it lived (or as this one
  // needed) to be taken in, and past kMaxLateRuns lone weights are not taken in any more.
  // Called when a planned weight died, and before taking one in.
  void note_late_deaths() {
    for (auto it = late_admits.begin(); it != late_admits.end();) {
      if (!it->weak.expired()) {
        ++it;
        continue;
      }
      // Twice its life: `periods` counts only periods that followed a plan (not recordings).
      const int64_t lived = periods - it->marked_at;
      const int64_t next = 2 * std::max<int64_t>(late_runs, lived);
      late_runs = next > kMaxLateRuns ? kLoneClosed : static_cast<int>(next);
      it = late_admits.erase(it);
    }
  }

  // Whether a model came since the last admission: at least kModelWeights weights marked lately
  // since then are alive, or as many bytes as half the plan's weights (Note [Inputs reused for
  // a few passes]). Not by how many of the plan's weights died: a deleted model's staged copies
  // keep its weights alive a while.
  bool new_arrivals() {
    size_t n = 0;
    size_t bytes = 0;
    for (const auto& [s, w] : weights) {
      if (w.marked > rec_marks && marked_lately(w) && !w.weak.expired()) {
        n++;
        bytes += s->nbytes();
      }
    }
    size_t plan_bytes = 0;
    for (const auto& [s, k] : first) plan_bytes += order[k].nbytes;
    return n >= kModelWeights || 2 * bytes >= plan_bytes;
  }

  // A new recording after the plan failed (misses, a new budget, moves that failed, a retry):
  // it admits what was marked since the last admission only if a model came meanwhile.
  void record_again() { start_recording(/*admit=*/new_arrivals()); }

  // A planned weight died (prefetch() or release_staging() found it): a new model (Note
  // [Streaming plan]), or an input reused for a few passes or a weight the user dropped.
  void plan_died() {
    note_late_deaths();
    replans_in_row = 0;
    // What was learned of the loop goes, as it did before inputs were told apart: a plan that
    // a dead input ended may have been a fallback with a long min_period (a tiny model after a
    // 16-read streak outgrew the last plan: 40 steps of recording, found by review).
    forget_loop();
    start_recording(/*admit=*/new_arrivals());
  }

  // Lone weights outside the order read in kLateRuns periods in a row, this one included.
  // More than one of them (a second model's weights) come in at kLateRuns, as a weight known
  // to be a model's does (Note [Inputs reused for a few passes]).
  size_t persisting_unknowns() const {
    size_t n = 0;
    for (const auto& [s, u] : unknown_seen) n += u.run >= kLateRuns && u.period + 1 >= period ? 1 : 0;
    return n;
  }

  // Follows the plan with one (collapsed) read. Returns false when the plan was dropped.
  bool follow(const c10::StorageImpl* prev, const c10::StorageImpl* s) {
    if (hbm_capacity() != plan_capacity) {
      replans_in_row = 0;
      record_again();
      return false;
    }
    const size_t n = order.size();
    const size_t next = (cursor + 1) % n;
    size_t pos;
    if (order[next].s == s) {
      pos = next;
    } else if (s == order[cursor].s && unknown_streak > 0) {
      // Read again after reads outside the order (a frozen model's forward between this
      // forward and its backward): where the cursor is, not a new period (Note [Inputs
      // reused for a few passes]). A period that ends with the weight it begins with meets
      // the branch above.
      unknown_streak = 0;
      return true;
    } else {
      auto p = pairs.find(PairKey(prev, s));
      auto f = first.find(s);
      if (p == pairs.end() && f == first.end()) {
        // A table the plan knows as read by rows, read whole for once (Note [Row reads]).
        if (rows_read.count(s)) return true;
        // A weight outside the plan: a new one if it keeps being read (Note [Streaming plan]),
        // or if nothing planned is read any more (a new model; the old one may be alive).
        // Three periods in a row: a batch is read by one step's forward and backward, which
        // the period's boundary may split (two), and a fixed evaluation batch every few
        // periods (Note [Inputs are not weights]).
        auto [u, inserted] = unknown_seen.emplace(s, Unknown{period, 1});
        if (!inserted && period != u->second.period) {
          u->second.run = period == u->second.period + 1 ? u->second.run + 1 : 1;
          u->second.period = period;
        }
        if (u->second.run >= kLateRuns) {
          auto w = weights.find(s);
          const bool model = (w != weights.end() && w->second.of_model) || persisting_unknowns() >= kModelWeights;
          if (!model) note_late_deaths();
          if (model || u->second.run >= late_runs) {
            if (!model) admit_late(s);
            replans_in_row = 0;
            forget_loop();
            start_recording();
            return false;
          }
        }
        if (++unknown_streak >= kYoungStreak) {
          // A new model, or the plan is one turn of an inner loop whose next turn reads other
          // weights (an MoE layer's experts, read as slices of one stacked weight: the plan
          // was one layer's pair): Note [Periods that vary].
          replans_in_row = 0;
          outgrown(true);
          start_recording();
          return false;
        }
        return true;
      }
      st.mispredictions++;
      pos = p != pairs.end() ? p->second : f->second;
      // Note [Periods that vary]: a read that skips ahead within the prefetch window (a layer
      // dropped this step) finds its copy staged; it costs only the skipped copies.
      const size_t ahead = (pos + n - cursor) % n;
      if (ahead == 0 || cursor >= reach.size() || ahead > static_cast<size_t>(reach[cursor])) period_misses++;
    }
    if (pos <= cursor && !(pos == cursor && n == 1)) {
      // Wrapped: a period ended (a misprediction that jumps back ends one too).
      period++;
      periods++;
      if (reach_stale) compute_reach();
      if (stuck_retry_at >= 0 && period >= stuck_retry_at) {
        // Note [Promotions]: the moves that failed are tried again by a new plan.
        for (auto& w : weights) w.second.stuck = false;
        replans_in_row = 0;
        record_again();
        return false;
      }
    }
    period_reads++;
    cursor = pos;
    unknown_streak = 0;
    if (period_reads >= n && !judge_window()) return false;
    // Note [The plan measures between passes]: an arena the plan could not take when it was
    // made is taken where hbm holds the least.
    if (!arena && pos == low_pos && demote.empty() && promote.empty()) allocate_arena();
    return true;
  }

  bool valid(const Entry& e, const c10::StorageImpl* s) const {
    return !e.stale && e.src_ptr == s->data() && e.nbytes == s->nbytes();
  }

  // Drops staged copies outside the window (unless a kernel still uses them).
  void release_outside_window() {
    std::unordered_set<const c10::StorageImpl*> window;
    if (state == State::kStreaming && !order.empty()) {
      for (int k = 0; k <= reach[cursor]; ++k) window.insert(order[(cursor + k) % order.size()].s);
      for (size_t k = 1; k <= order[cursor].keeps; ++k) window.insert(order[(cursor + order.size() - k) % order.size()].s);
    } else if (last != nullptr) {
      window.insert(last);
    }
    for (auto it = staged.begin(); it != staged.end();) {
      if (window.count(it->first) == 0 && it->second.use_count() == 1) {
        drop(it->second);
        it = staged.erase(it);
      } else {
        ++it;
      }
    }
  }

  void drop(std::shared_ptr<Entry>& e) {
    st.staging_bytes -= static_cast<int64_t>(e->nbytes);
    graveyard.push_back(std::move(e));
  }

  // A fresh copy of `s` in hbm, or nullptr when hbm cannot hold it. Only the plan's weights
  // are staged in the arena: a copy of anything else (a batch) would take a prefetch's room.
  std::shared_ptr<Entry> stage(c10::StorageImpl* s, bool async) {
    MemoryManager& m = mm();
    const size_t n = s->nbytes();
    const bool planned = arena && first.count(s) != 0;
    void* block = planned ? arena->allocate(n) : m.try_allocate(n, Tier::kHbm);
    if (block == nullptr) return nullptr;
    if (!planned) {
      note_block_allocated(block, staging_device());
      g_staging_hbm.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    }
    auto e = std::make_shared<Entry>();
    if (planned) e->arena = arena;
    e->source = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s);
    e->src_ptr = s->data();
    e->nbytes = n;
    e->mm = &m;
    e->block = block;
    e->copier = &copier();
    e->prefetched = async;
    if (async) {
      e->ticket = e->copier->issue(block, e->src_ptr, n);
      st.prefetched++;
    } else {
      RECORD_FUNCTION("superchip::stage_weight", std::vector<c10::IValue>());
      e->copier->copy_now(block, e->src_ptr, n);
    }
    st.staged_copies++;
    st.staged_bytes += static_cast<int64_t>(n);
    st.staging_bytes += static_cast<int64_t>(n);
    st.staging_peak_bytes = std::max(st.staging_peak_bytes, st.staging_bytes);
    return e;
  }

  bool in_host(const c10::StorageImpl* s) const {
    return s->data() != nullptr && storage_tier(*s) == Tier::kHost;
  }

  // Dropped copies no kernel uses give their blocks back now: the graveyard itself empties
  // after the read, too late for this read's copy and prefetch, which would find the arena
  // full (a copy at use, or a read in place, every other read). Operator threads only (CUDA
  // orders a block's release with their current stream).
  void free_dropped_blocks() {
    for (auto& e : graveyard) {
      if (e.use_count() == 1) e->release_block();
    }
  }

  // Issues copies for the window ahead of the cursor. False when a planned weight died.
  bool prefetch() {
    if (state != State::kStreaming || order.empty()) return true;
    free_dropped_blocks();
    size_t budget_used = 0;  // the arena's copies (a batch's copy at use is outside it)
    for (const auto& kv : staged) {
      if (kv.second->arena) budget_used += kv.second->nbytes;
    }
    // The reads of the rotation before the cursor first (Note [Rotating reads]: read again
    // next, their copies stale when a write came between), then the window ahead.
    const size_t n = order.size();
    const auto behind = static_cast<int>(order[cursor].keeps);
    for (int k = -behind; k <= reach[cursor]; ++k) {
      if (k == 0) continue;
      const Item& it = order[(cursor + n + static_cast<size_t>(k < 0 ? n + k : k)) % n];
      auto found = staged.find(it.s);
      if (found != staged.end() && valid(*found->second, it.s)) continue;
      if (it.weak.expired()) return false;
      // Alive: the weak reference keeps the address from being reused, and some tensor holds
      // a strong one, which stage() copies on this (operator) thread.
      auto* s = const_cast<c10::StorageImpl*>(it.s);
      if (!in_host(s) || s->nbytes() != it.nbytes) continue;
      if (OffloadEngine::get().is_pending(s)) continue;
      if (found != staged.end()) {
        if (found->second.use_count() > 1) continue;  // in use: replaced after the kernel
        if (found->second->arena) budget_used -= found->second->nbytes;  // stale: its room is ours
        found->second->release_block();
        drop(found->second);
        staged.erase(found);
      }
      if (budget_used + it.nbytes > staging_budget) break;  // the arena's free list decides too
      std::shared_ptr<Entry> e = stage(s, /*async=*/true);
      if (!e) break;
      budget_used += it.nbytes;
      staged.emplace(it.s, std::move(e));
    }
    return true;
  }

  // Erases `it` if its storage died. Its address may be reused then: what was seen of it
  // (read outside the plan, read by rows) goes too.
  bool forget_if_dead(std::unordered_map<const c10::StorageImpl*, Weight>::iterator& it) {
    if (!it->second.weak.expired()) return false;
    unknown_seen.erase(it->first);
    rows_read.erase(it->first);
    it = weights.erase(it);
    return true;
  }

  void maybe_purge_weights() {
    // Note [Dead batches leave soon]
    const size_t n = mark_queue.size();
    for (size_t k = std::min<size_t>(n, std::min<size_t>(64, std::max<size_t>(8, n / 8))); k > 0; --k) {
      const auto [s, marked] = mark_queue.front();
      mark_queue.pop_front();
      auto it = weights.find(s);
      // Gone already (the purge below, or a new storage at its address marked since): done.
      if (it == weights.end() || it->second.marked != marked || forget_if_dead(it)) continue;
      mark_queue.emplace_back(s, marked);
    }
    if (weights.size() < purge_at) return;
    for (auto it = weights.begin(); it != weights.end();) {
      if (!forget_if_dead(it)) ++it;
    }
    purge_at = std::max<size_t>(1024, weights.size() * 2);
  }
};

WeightStreamer& WeightStreamer::get() {
  static WeightStreamer* s = new WeightStreamer();  // leaked: see impl_
  return *s;
}

WeightStreamer::WeightStreamer() : impl_(new Impl()) {
  // Constructed while _C is imported: a c10::Error raised there reaches Python with its C++
  // backtrace, so it waits for check_environment(), which superchip's _init calls.
  try {
    impl_->enabled = env_enabled();
  } catch (const c10::Error& e) {
    impl_->env_error = e.what_without_backtrace();
    impl_->enabled = false;
  }
  OffloadEngine::get().set_written_hook(
      [](const c10::StorageImpl* s) noexcept { WeightStreamer::get().note_written(s); });
}

bool WeightStreamer::active() const noexcept { return impl_->active.load(std::memory_order_acquire); }

void WeightStreamer::check_environment() {
  const std::string& error = get().impl_->env_error;
  TORCH_CHECK(error.empty(), error);
}

bool WeightStreamer::idle() const noexcept {
  try {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->state == State::kIdle;
  } catch (...) {
    return false;  // the mutex failed (std::system_error): assume a plan may be moving weights
  }
}

bool WeightStreamer::enabled() const noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->enabled;
}

void WeightStreamer::mark_weight(c10::StorageImpl& storage, bool of_model) {
  if (storage.nbytes() < kMinBytes) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->maybe_purge_weights();
  auto it = impl_->weights.find(&storage);
  if (it == impl_->weights.end() || it->second.weak.expired()) {
    // A new storage, perhaps at a dead one's address (each step's batch may take the last
    // one's): what was seen of that one is not its.
    impl_->unknown_seen.erase(&storage);
    impl_->rows_read.erase(&storage);
    impl_->weights.insert_or_assign(
        &storage, Impl::Weight{c10::weak_intrusive_ptr<c10::StorageImpl>(
                                   c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(&storage)),
                               ++impl_->marks, false, false, false, impl_->periods});
    impl_->mark_queue.emplace_back(&storage, impl_->marks);
    // Note [Inputs are not weights]: a model's weight is not young.
    if (of_model && impl_->state == State::kRecording) {
      impl_->forget_loop();
      impl_->start_recording();
    }
  }
  if (of_model) {
    // Known now (a parameter an optimizer steps): not young any more, so a recording that left
    // it out begins again, as for a model's weight marked while recording.
    Impl::Weight& w = impl_->weights.find(&storage)->second;  // inserted or alive
    const bool was_young = impl_->young(w);
    w.of_model = true;
    if (was_young && impl_->state == State::kRecording) impl_->start_recording();
  }
  // Active (operators call read()) once some weight lives in host: a model that fits in hbm
  // costs its operators one atomic load.
  if (impl_->enabled && impl_->in_host(&storage)) impl_->active.store(true, std::memory_order_release);
}

bool WeightStreamer::is_weight(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->weights.find(storage);
  return it != impl_->weights.end() && !it->second.weak.expired();
}

bool WeightStreamer::following_live_plan() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->state != State::kStreaming || impl_->order.empty()) return false;
  for (const auto& it : impl_->order) {
    if (it.weak.expired()) return false;
  }
  return true;
}

void WeightStreamer::note_placed_by_hand(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->weights.find(storage);
  if (it != impl_->weights.end() && !it->second.weak.expired()) it->second.by_hand = true;
}

void WeightStreamer::note_moved_to_host(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->enabled && impl_->weights.count(storage)) impl_->active.store(true, std::memory_order_release);
}

c10::StorageImpl* WeightStreamer::source_of(const c10::DataPtr& staged) noexcept {
  if (staged.get_deleter() != &staged_release) return nullptr;
  return static_cast<StagedUse*>(staged.get_context())->entry->source.get();
}

c10::DataPtr WeightStreamer::read(c10::StorageImpl* s, c10::Device executor_device) {
  // The engine's worker reads in place: entries hold storages, which only operator threads
  // may reference (Note [Engine and the GIL]).
  if (!active() || OffloadEngine::on_worker()) return {};
  // Last out, after the lock and `dead`: a plan made by this read asks for apply().
  struct RequestApply {
    Impl& d;
    ~RequestApply() {
      if (d.apply_wanted.load(std::memory_order_relaxed) && d.apply_wanted.exchange(false)) {
        if (ApplyRequest hook = d.apply_hook.load(std::memory_order_acquire)) hook();
      }
    }
  } request{*impl_};
  std::vector<std::shared_ptr<Entry>> dead;
  c10::DataPtr result;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    Impl& d = *impl_;
    if (!d.enabled) return {};
    // Weights only decide the device and (CUDA) the compute stream copies are ordered with:
    // an activation read first on a side stream or another device used to pin those.
    auto w = d.weights.find(s);
    if (w == d.weights.end() || s->nbytes() < kMinBytes) return {};
    if (d.device < 0) d.device = s->device().index();
    if (s->device().index() != d.device) return {};  // another device's weight: in place
    // CUDA: copies we cannot order with the current stream are not made (StagingCopier.h).
    if (!d.copier().usable()) return {};
    // Every weight's reads make the order (stationary ones too: the plan may demote them);
    // only those in host are staged.
    const bool host = d.in_host(s);
    // A batch (Note [Inputs are not weights]) neither ends a rotation nor is remembered: read
    // inside an inner loop (an MoE layer's experts reading the model's input), it would hide
    // the rotation.
    const bool batch = d.state != State::kIdle && d.young(w->second);
    if (s == d.actual) {
      // Read again at once: counts once.
      if (s == d.last && d.rotation == 0 && d.recent_n > 0) d.recent_twice[d.recent_n - 1] = true;
    } else if (d.actual = s; !batch && d.rotates(s)) {
      // Note [Rotating reads]: not a read of the order.
    } else {
      const c10::StorageImpl* prev = d.last;
      if (!batch) d.remember(s);
      switch (d.state) {
        case State::kIdle:
          d.start_recording(d.admit_on_start);
          d.record(prev, s, s->nbytes());
          break;
        case State::kRecording:
          d.record(prev, s, s->nbytes());
          break;
        case State::kStreaming:
          if (!d.follow(prev, s)) d.record(nullptr, s, s->nbytes());
          break;
        case State::kUnplanned:
          // Note [Periods that vary]: tried again, less often each time.
          if (++d.unplanned_reads >= d.unplanned_retry) {
            d.unplanned_retry = std::min(kMaxRetry, 2 * d.unplanned_retry);
            d.replans_in_row = 0;
            d.record_again();
            d.record(prev, s, s->nbytes());
          }
          break;
      }
      d.release_outside_window();
    }
    d.free_dropped_blocks();  // copies dropped by this read or by writes since the last one
    if (!host) {
      if (!d.prefetch()) d.plan_died();
      dead.swap(d.graveyard);
      return {};
    }
    // The copy for this read.
    std::shared_ptr<Entry> e;
    auto found = d.staged.find(s);
    if (found != d.staged.end() && d.valid(*found->second, s)) {
      e = found->second;
      d.st.hits++;
      if (e->ticket) {
        // Emulated: waits for the copier thread (once). CUDA: the current stream waits for
        // the copy's event, for every kernel that reads it (it may be on another stream).
        RECORD_FUNCTION("superchip::wait_weight", std::vector<c10::IValue>());
        if (d.copier().make_visible(*e->ticket)) d.st.prefetch_waits++;
      }
    } else {
      if (found != d.staged.end()) {
        if (found->second.use_count() == 1) d.drop(found->second);
        else d.st.staging_bytes -= static_cast<int64_t>(found->second->nbytes);  // leaves with its last use
        d.staged.erase(found);
      }
      e = d.stage(s, /*async=*/false);
      if (!e && d.arena && d.first.count(s) != 0) {
        // The arena has the room (the plan sized the window) but copies no kernel uses split
        // it (an LM head after an MLP's last weight): they go, prefetch stages them again.
        for (auto it = d.staged.begin(); it != d.staged.end();) {
          if (it->second.use_count() == 1) {
            it->second->release_block();
            d.drop(it->second);
            it = d.staged.erase(it);
          } else {
            ++it;
          }
        }
        e = d.stage(s, /*async=*/false);
      }
      if (e) {
        d.st.staged_at_use++;
        d.staged.emplace(s, e);
      } else {
        d.st.in_place_reads++;
      }
    }
    if (!d.prefetch()) d.plan_died();
    if (e) {
      auto* use = new StagedUse{e};
      result = c10::DataPtr(e->block, use, &staged_release, executor_device);
    }
    dead.swap(d.graveyard);
  }
  // `dead` releases its copies (and their storages) here: an operator thread, no lock held.
  return result;
}

void WeightStreamer::note_rows_read(const c10::StorageImpl* s) {
  if (!active() || OffloadEngine::on_worker() || s->nbytes() < kMinBytes) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& d = *impl_;
  if (d.state == State::kRecording && d.weights.count(s)) d.rows_read.insert(s);
}

void WeightStreamer::note_written(const c10::StorageImpl* s) noexcept {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->staged.find(s);
  if (it == impl_->staged.end()) return;
  it->second->stale = true;
  impl_->st.invalidated++;
  if (it->second.use_count() == 1) {
    impl_->drop(it->second);
  } else {
    impl_->st.staging_bytes -= static_cast<int64_t>(it->second->nbytes);
  }
  impl_->staged.erase(it);
}

namespace {
std::atomic<int> g_threads_in_operators{0};
std::atomic<bool> g_concurrent_operators{false};
thread_local int t_operator_depth = 0;
}  // namespace

WeightStreamer::OperatorScope::OperatorScope() noexcept {
  if (t_operator_depth++ > 0 || OffloadEngine::on_worker()) return;
  counted_ = true;
  if (g_threads_in_operators.fetch_add(1, std::memory_order_acq_rel) == 0) return;
  if (g_concurrent_operators.load(std::memory_order_acquire)) return;
  WeightStreamer& streamer = WeightStreamer::get();
  // Before any weight read was recorded there is no plan, so nothing moves: threads that load a
  // model together (transformers 5 copies checkpoint tensors onto the device from a pool of
  // four) are not the hazard this guards against, and must not turn streaming off for the
  // training that follows.
  if (streamer.idle()) return;
  if (g_concurrent_operators.exchange(true, std::memory_order_acq_rel)) return;
  if (!streamer.enabled()) return;
  std::fprintf(stderr,
               "superchip: two threads ran superchip operators at the same time; weight streaming "
               "is turned off for this process (weights stay in their tiers, host ones are read in "
               "place: results unchanged, slower). Weight streaming moves weights between tiers for "
               "one thread's operators at a time (Note [One thread runs the operators]).\n");
  try {
    streamer.set_enabled(false);
  } catch (...) {
    // Only its mutex can throw (std::system_error): streaming then stays on, as before.
  }
}

WeightStreamer::OperatorScope::~OperatorScope() {
  --t_operator_depth;
  if (counted_) g_threads_in_operators.fetch_sub(1, std::memory_order_acq_rel);
}

void WeightStreamer::set_enabled(bool enabled) {
  std::vector<std::shared_ptr<Entry>> dead;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->enabled = enabled;
    if (!enabled) {
      impl_->active.store(false, std::memory_order_release);
      for (auto& [s, e] : impl_->staged) {
        impl_->st.staging_bytes -= static_cast<int64_t>(e->nbytes);
        dead.push_back(std::move(e));
      }
      impl_->staged.clear();
      impl_->state = State::kIdle;
      impl_->forget_reads();
      impl_->start_recording();
      impl_->state = State::kIdle;
    } else {
      for (const auto& [s, w] : impl_->weights) {
        if (!w.weak.expired() && impl_->in_host(s)) {
          impl_->active.store(true, std::memory_order_release);
          break;
        }
      }
    }
    for (auto& e : impl_->graveyard) dead.push_back(std::move(e));
    impl_->graveyard.clear();
  }
}

void WeightStreamer::set_apply_request_hook(ApplyRequest hook) {
  impl_->apply_hook.store(hook, std::memory_order_release);
}

bool WeightStreamer::apply() {
  impl_->apply_wanted.store(false, std::memory_order_relaxed);
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> demote;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> promote;
  int64_t version = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    demote.swap(impl_->demote);
    promote.swap(impl_->promote);
    version = impl_->version;
  }
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> failed;  // moves that did not happen
  for (const auto& w : demote) {
    c10::intrusive_ptr<c10::StorageImpl> s = w.lock();
    if (!s) continue;
    OffloadEngine::get().wait_for_storage(s.get());
    try {
      move_storage_to_tier(*s, Tier::kHost);
    } catch (const std::exception&) {
      // host is full or a collective holds the bytes: the weight stays in hbm.
      failed.push_back(w);
    }
  }
  // Note [Promotions]: what hbm cannot take now is tried again once the optimizer's queued
  // steps have run (their jobs hold the last step's gradients), then at a later apply().
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> left;
  for (int round = 0; round < 2 && !promote.empty(); ++round) {
    if (round == 1) {
      // An optimizer's failed queued step is its own to raise (at its next step()), not a
      // forward's: this waits, leaving kept errors where they are.
      OffloadEngine::get().synchronize(/*charge_exposed=*/true, /*raise_errors=*/false);
      OffloadEngine::get().release_finished();
    }
    left.clear();
    for (const auto& w : promote) {
      c10::intrusive_ptr<c10::StorageImpl> s = w.lock();
      if (s && !try_move_storage_to_tier(*s, Tier::kHbm)) left.push_back(w);
    }
    promote.swap(left);
  }
  left.swap(promote);
  // Strong references to the weights whose moves failed, released after the lock (a storage
  // may not die under it).
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> unmoved;
  for (const auto* list : {&failed, &left}) {
    for (const auto& w : *list) {
      if (auto s = w.lock()) unmoved.push_back(std::move(s));
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& d = *impl_;
  // A new plan has its own moves; a dropped one (recording again), none.
  if (d.version != version || d.state != State::kStreaming) return false;
  if (!left.empty() && failed.empty() && ++d.apply_tries < kApplyTries) {
    d.promote = std::move(left);
    return true;
  }
  if (!failed.empty() || !left.empty()) {
    // The plan's arena and window were sized for moves that did not happen: it is redone
    // from where the weights are, which no plan moves again until the budget changes.
    d.demoted -= static_cast<int64_t>(failed.size());
    d.promoted -= static_cast<int64_t>(left.size());
    for (const auto& s : unmoved) {
      auto it = d.weights.find(s.get());
      if (it != d.weights.end()) it->second.stuck = true;
    }
    d.stuck_capacity = d.plan_capacity;
    d.stuck_backoff = d.stuck_backoff == 0 ? kStuckRetry : std::min(2 * d.stuck_backoff, kStuckRetryMax);
    d.replans_in_row = 0;
    d.record_again();
    return false;
  }
  d.allocate_arena();
  return false;
}

void WeightStreamer::replan() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->replans_in_row = 0;
  impl_->forget_loop();
  impl_->forget_reads();
  impl_->start_recording();
  impl_->state = State::kIdle;
}

void WeightStreamer::prepare_fork() {
  // Not under mu: a thread holding mu may be waiting for the engine, which Fork.cpp has locked.
  impl_->forking = impl_->created_copier.load(std::memory_order_acquire);
  if (impl_->forking != nullptr) impl_->forking->prepare_fork();
}

void WeightStreamer::after_fork(bool child) {
  if (impl_->forking != nullptr) impl_->forking->after_fork(child);
  impl_->forking = nullptr;
}

void WeightStreamer::release_staging() {
  std::vector<std::shared_ptr<Entry>> dead;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    Impl& d = *impl_;
    for (auto it = d.staged.begin(); it != d.staged.end();) {
      if (it->second.use_count() == 1) {
        d.drop(it->second);
        it = d.staged.erase(it);
      } else {
        ++it;
      }
    }
    // A plan whose weights died (the model was deleted) would keep its arena in hbm until the
    // next weight read: it goes now, with the plan (the next reads record anew).
    bool plan_dead = false;
    for (const auto& it : d.order) plan_dead |= it.weak.expired();
    if (plan_dead) {
      d.plan_died();  // drops the arena: freed with its last copy, in `dead`
      d.forget_reads();
      d.state = State::kIdle;
    }
    dead.swap(d.graveyard);
  }
}

StreamStats WeightStreamer::stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  StreamStats s = impl_->st;
  s.copy_seconds = impl_->copy_seconds();
  return s;
}

void WeightStreamer::reset_stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int64_t in_use = impl_->st.staging_bytes;
  impl_->st = StreamStats();
  impl_->st.staging_bytes = in_use;
  impl_->st.staging_peak_bytes = in_use;
  if (impl_->copier_) {
    impl_->seconds_at_reset = impl_->copier_->seconds();
    impl_->bytes_at_reset = impl_->copier_->measured_bytes();
  }
}

StreamPlan WeightStreamer::plan() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& d = *impl_;
  StreamPlan p;
  p.state = !d.enabled ? "off" : d.active.load() ? state_name(d.state) : "idle";
  // Staged copies, unless the copies cannot be ordered with the current CUDA stream.
  p.mode = d.copier_ == nullptr || d.copier_->usable() ? "stage" : "in_place";
  if (!d.enabled) return p;
  p.version = d.version;
  for (const auto& it : d.order) {
    p.order.push_back({it.s, it.nbytes, !it.weak.expired() && d.in_host(it.s)});
  }
  for (const auto& it : d.row_only) {
    if (!it.weak.expired()) p.row_reads.push_back({it.s, it.nbytes, d.in_host(it.s)});
  }
  p.demoted = d.demoted;
  p.promoted = d.promoted;
  p.streamed_bytes = d.streamed_bytes;
  p.hbm_capacity = d.order.empty() ? d.hbm_capacity() : d.plan_capacity;  // no plan: the budget now
  p.activation_peak_bytes = d.activation_peak;
  p.staging_budget = d.staging_budget;
  p.prefetch_depth = d.depth;
  const double secs = d.copy_seconds();
  p.copy_bytes_per_s = secs > 0 ? d.copy_bytes() / secs : 0.0;
  return p;
}

}  // namespace superchip
