// The offload engine's runtime: one worker thread that runs optimizer jobs (bucket copies,
// CPU steps, validations, rollbacks) in submission order, and the per-storage pending table
// that makes the asynchronous step look synchronous (Note [Pending storages]).
// Contract:
//  - A job names the storages it reads or writes; from submit() until the job has run, any
//    operator on another thread that touches one of them (every forwarded operand, copies,
//    .item(), move_to_tier) waits for exactly those jobs: wait_for_storage().
//  - A speculation hold marks storages whose visible bytes are speculative (a step that has
//    not been validated yet). Touching a held storage first runs the hold's rollback, then
//    proceeds: the reader sees the values of the plain, unstepped run. A job submitted over a
//    storage another hold holds does the same (Note [Holds of another speculation]).
//  - No tensor, storage or hold is ever released on the worker or under the engine's lock: since
//    torch 2.10 a C++ reference count moving between 1 and 2 on a tensor or storage that has a
//    Python object takes the GIL, and a thread that holds the GIL may be waiting on the worker
//    or on the lock (Note [Engine and the GIL]). A job's closure, `touched` and `keep`, and a
//    hold that ends, are released by the next submit/wait/synchronize on a caller's thread.
//    A job body that replaces a tensor it was given (a snapshot replacing a gradient) keeps
//    the original in the job's `keep`.
//  - CUDA executor: a job runs after the GPU work its submitting thread had queued when it
//    was submitted (an event per device), not after work queued since; the worker's own GPU
//    copies run on side streams (Note [Engine jobs and GPU streams]).
//  - Exceptions thrown by a job are kept, the first of each owner, until raised once: by the
//    next wait/synchronize that raises errors (the oldest kept, whoever's), or by its owner
//    (take_error(): an optimizer raises its own from its next step()). The worker goes on with
//    the next job. The job's ticket is kept for its owner until take_failures() (the optimizer
//    restores the bookkeeping of a step that did not run).
//  - fork() (Note [Fork] in register/Fork.cpp): prepare_fork() waits until every queued job
//    has run and keeps the engine locked until after_fork(); a child starts with no job in
//    flight and no worker, and its first job starts a new worker.
// Thread-safety: every member may be called from any thread except the worker itself.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace superchip {

struct EngineJob {
  const char* name = "superchip::job";       // profiler range of the job
  int64_t owner = 0;                         // the optimizer that submitted it (stats)
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> touched;  // pending until it has run
  std::function<void()> run;                 // runs on the worker
  std::vector<at::Tensor> keep;              // kept alive until released on a caller's thread
  // CUDA executor: recorded at submit() on the submitting thread's streams; the worker waits
  // for them before the job (Note [Engine jobs and GPU streams]).
  std::vector<std::shared_ptr<c10::Event>> ready;
};

// Rollback of speculative storages, triggered by a reader (see hold()).
class SpeculationHold {
 public:
  virtual ~SpeculationHold() = default;
  // Undoes the speculative bytes, on the worker; called at most once.
  virtual void rollback() = 0;
  virtual int64_t owner() const = 0;
  // The storages the hold covers; set by OffloadEngine::hold().
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
};

struct OwnerStats {
  double optimizer_seconds = 0.0;  // worker time in this owner's jobs
  double exposed_seconds = 0.0;    // time other threads waited for this owner's jobs
  int64_t rollbacks_on_read = 0;   // speculations undone because a reader touched them
};

class OffloadEngine {
 public:
  static OffloadEngine& get();

  // Queues `job`; returns its ticket (tickets increase by one per job).
  uint64_t submit(EngineJob job);
  // Blocks until the job with `ticket` (and every job before it) has run; counts the wait as
  // exposed time of `owner` (kNoOwner: of no one). Re-raises the oldest kept job exception.
  static constexpr int64_t kNoOwner = -1;
  void wait(uint64_t ticket, int64_t owner, bool raise_errors = true);
  // Waits for every queued job; the wait counts as exposed time of the last job's owner, unless
  // `charge_exposed` is false (offload_stats(): reading the counters must not change them).
  // `raise_errors` false: kept exceptions stay for their owners (an optimizer's own wait).
  void synchronize(bool charge_exposed = true, bool raise_errors = true);
  // Called for every operand of an operator: returns at once when nothing is pending.
  void wait_for_storage(const c10::StorageImpl* s);
  // Called on the worker, outside the engine's lock, for each storage of a job after it ran
  // (the weight streamer drops its staged copies of them). noexcept; nullptr: none.
  using WrittenHook = void (*)(const c10::StorageImpl*) noexcept;
  void set_written_hook(WrittenHook hook);
  // GPU ordering (Note [Engine jobs and GPU streams]), installed by the backend
  // (engine/GpuOrder.cpp; the engine's own tests run without): `ready` returns the events a job
  // touching those storages waits for, recorded on the submitting thread; `worker_start` runs
  // first on the worker thread. nullptr: none.
  using ReadyEvents = std::vector<std::shared_ptr<c10::Event>> (*)(
      const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& touched);
  using WorkerStart = void (*)();
  // Waits for the GPU work the worker queued on its own streams during a job.
  using WorkerJobEnd = void (*)(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& touched);
  void set_gpu_order(ReadyEvents ready, WorkerStart worker_start, WorkerJobEnd job_end = nullptr);
  // Whether a queued job or a hold covers `s` now (the weight streamer's prefetch skips it).
  bool is_pending(const c10::StorageImpl* s);
  // Marks `storages` speculative until submit_replacing_hold() ends the hold; a reader first
  // triggers hold->rollback().
  void hold(std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages,
            std::shared_ptr<SpeculationHold> hold);
  // Queues `job` and ends `hold` in one step, so no reader falls between the two (the job,
  // which must touch the hold's storages, then decides: validate, or roll back).
  uint64_t submit_replacing_hold(EngineJob job, const SpeculationHold* hold);
  OwnerStats stats(int64_t owner);
  // The tickets of `owner`'s jobs that threw since the last call, in order, and the last ticket
  // that has run (every earlier job has run too).
  struct Failures {
    std::vector<uint64_t> tickets;
    uint64_t done_upto = 0;
  };
  Failures take_failures(int64_t owner);
  // `owner`'s kept exception, if one was not raised yet; it will not be raised again.
  std::exception_ptr take_error(int64_t owner);
  void add_exposed(int64_t owner, double seconds);
  // Releases finished jobs' tensors; call from a thread that may take the GIL.
  void release_finished();
  static bool on_worker();

  // fork() handlers (see above). prepare_fork() must not be called on the worker; after_fork()
  // only after a prepare_fork() on the same thread.
  void prepare_fork();
  void after_fork(bool child);

 private:
  OffloadEngine();
  ~OffloadEngine();
  void worker_loop();
  uint64_t submit_locked(EngineJob job);  // under mu_; job.run already wrapped; starts the worker
  void drop_hold_locked(const SpeculationHold* hold);
  // Under mu_: holds other than `own` on the storages `job` touches become rollback jobs queued
  // first (Note [Holds of another speculation] in OffloadEngine.cpp).
  void roll_back_other_holds_locked(const EngineJob& job, const SpeculationHold* own);
  // Under mu_: `h` becomes a rollback job over its storages, queued now, and stops holding them.
  void queue_rollback_locked(const std::shared_ptr<SpeculationHold>& h);
  void wrap(EngineJob& job);  // on the submitting thread: its ThreadLocalState and ready events
  void finish(EngineJob& job, double seconds);

  struct Entry {
    int jobs = 0;
    int64_t owner = 0;
    std::shared_ptr<SpeculationHold> hold;
  };

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::pair<uint64_t, EngineJob>> queue_;
  std::vector<EngineJob> finished_;
  std::vector<std::shared_ptr<SpeculationHold>> ended_holds_;  // released with finished_
  std::unordered_map<const c10::StorageImpl*, Entry> pending_;
  std::unordered_map<int64_t, OwnerStats> stats_;
  std::vector<std::pair<int64_t, std::exception_ptr>> errors_;  // (owner, its first), oldest first
  std::unordered_map<int64_t, std::vector<uint64_t>> failed_;  // owner -> tickets that threw
  uint64_t next_ticket_ = 1;
  int64_t last_owner_ = kNoOwner;  // of the last job submitted: synchronize() charges it
  uint64_t done_upto_ = 0;
  bool stop_ = false;
  std::atomic<int64_t> active_{0};      // pending entries: the fast path reads only this
  std::atomic<bool> has_finished_{false};
  std::atomic<WrittenHook> written_hook_{nullptr};
  std::atomic<ReadyEvents> ready_events_{nullptr};
  std::atomic<WorkerStart> worker_start_{nullptr};
  std::atomic<WorkerJobEnd> job_end_{nullptr};
  std::thread worker_;  // started by the first job (again in a forked child)
};

}  // namespace superchip
