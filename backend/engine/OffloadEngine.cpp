#include "backend/engine/OffloadEngine.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <new>


// Note [Pending storages]
// The optimizer step behaves like a kernel launch: step() queues jobs and returns, and an
// operator that touches a storage a queued job uses waits for that job only. The table maps
// a StorageImpl to the number of queued jobs that use it (and to a speculation hold, see the
// header). Operators call wait_for_storage() for every superchip operand (executor_alias,
// the one place every forwarded operand, copy and .item() passes); when nothing is pending it
// costs one acquire load of active_ (a plain load on x86). Acquire, not relaxed: a reader that
// sees 0 reads the bytes at once, so the worker's writes must happen-before it; every
// decrement is a release, made after the job ran (ThreadSanitizer found the relaxed version,
// which on Grace's weaker memory model could read a parameter mid-step). The worker itself
// never waits (its jobs touch the storages they are pending on).
//
// Note [Engine and the GIL]
// Since torch 2.10, a tensor or storage with a Python object keeps that object alive while C++
// holds a reference too: a C++ reference count going 1 -> 2 or 2 -> 1 calls into Python and
// takes the GIL. The training thread holds the GIL while it runs an operator, so while it
// waits (wait_for_storage from that operator, or for mu_), the worker must never need the
// GIL, and no thread may need it while holding mu_. So: nothing that holds tensors is
// destroyed on the worker or under mu_. Finished jobs and ended holds are parked in
// finished_ / ended_holds_ and released by release_finished() on a caller's thread, after mu_
// is unlocked; job bodies keep every tensor they replace in the job's `keep`. (Breaking this
// rule deadlocks: the first runs that did, stalled, with the worker in decref_pyobject
// waiting for the GIL and the training thread waiting for mu_ in submit().)
//
// Jobs run under the ThreadLocalState of the thread that submitted them, so the profiler's
// callbacks follow them onto the worker and their `superchip::...` ranges show up in traces.

// Note [Engine jobs and Python modes]
// That state also carries the submitter's TorchDispatchMode stack (a FlopCounterMode, a
// logging mode, FakeTensorMode) around `loss.backward()` or `opt.step()`. Under it, the ATen
// operations a job runs on executor aliases (the snapshot's cast and copy, validation's
// `equal`, a strided write-back) went to the mode's Python __torch_dispatch__, on the worker:
// the user's mode saw our internal copies, on a thread it did not expect, and the worker took
// the GIL for each, which the Note above forbids. A job excludes the Python dispatch keys: the
// modes see what the plain step shows them (the plain step runs no operator a mode sees).

// Note [Engine jobs and GPU streams]
// Under the CUDA executor a job's CPU work reads what GPU kernels wrote (gradients, from
// backward) and writes what they read (parameters). It used to synchronize the whole device
// first (cudaDeviceSynchronize, from FusedStep's wait_for_executor); but by then the training
// thread has queued more: the rest of backward while a bucket speculates, the next forward while
// the asynchronous step runs. So every job waited for that too, and on one shared stream its
// copies queued behind it: the CPU step could not overlap the GPU work it exists to hide. Now
// submit() records an event on the submitting thread's current stream of each device the job
// touches (the stream that produced those gradients or read those parameters; the autograd
// thread's stream for a bucket finished in backward), and the worker waits for exactly those
// events before the job. Work queued after submit() cannot touch the job's storages before the
// job ends: operators wait for pending storages (Note [Pending storages]) before they enqueue.
// The worker's own GPU work (gradient snapshots, staging copies, write-backs) runs on pool
// streams, one per device, set as its current streams: synchronous copies there wait for
// nothing but themselves. Not yet run on a GPU: the exactness tests under the CUDA executor
// check it. The two functions live in engine/GpuOrder.cpp (they need the runtime); the backend
// installs them with set_gpu_order().

namespace superchip {
namespace {

thread_local bool t_on_worker = false;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

OffloadEngine& OffloadEngine::get() {
  // Leaked on purpose: the worker must outlive every static that a job may still use at exit.
  static OffloadEngine* engine = new OffloadEngine();
  return *engine;
}

OffloadEngine::OffloadEngine() = default;

OffloadEngine::~OffloadEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

bool OffloadEngine::on_worker() { return t_on_worker; }

void OffloadEngine::wrap(EngineJob& job) {
  if (ReadyEvents ready = ready_events_.load(std::memory_order_acquire)) job.ready = ready(job.touched);
  auto tls = std::make_shared<at::ThreadLocalState>();
  auto body = std::move(job.run);
  const char* name = job.name;
  job.run = [tls, body = std::move(body), name] {
    at::ThreadLocalStateGuard tls_guard(*tls);
    // Not the user's Python dispatch modes (Note [Engine jobs and Python modes]).
    c10::impl::ExcludeDispatchKeyGuard no_python_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    RECORD_FUNCTION(name, std::vector<c10::IValue>());
    body();
  };
}

uint64_t OffloadEngine::submit_locked(EngineJob job) {
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  const uint64_t ticket = next_ticket_++;
  last_owner_ = job.owner;
  for (const auto& s : job.touched) {
    Entry& e = pending_[s.get()];
    if (e.jobs++ == 0 && !e.hold) active_.fetch_add(1, std::memory_order_relaxed);
    e.owner = job.owner;
  }
  queue_.emplace_back(ticket, std::move(job));
  return ticket;
}

// Note [Holds of another speculation]
// A job that writes storages held by a speculation other than its own (a second optimizer
// over the same parameters: one rebuilt while a scheduler still holds the old one, whose hooks
// still speculate at every backward) used to run on top of the speculative step, and hold()
// took the storages over from the first hold without undoing it. The first speculation's
// undo then ran, whenever it came, on values another step had changed since: not exact (found
// by review; the new optimizer's results drifted from overlap=False's). Such a job is a
// writer like any other: the hold becomes a rollback job queued before it, as for a reader
// (wait_for_storage); that speculation, validated later, finds itself rolled back and its
// optimizer steps plainly.
void OffloadEngine::roll_back_other_holds_locked(const EngineJob& job, const SpeculationHold* own) {
  std::vector<std::shared_ptr<SpeculationHold>> others;
  for (const auto& s : job.touched) {
    auto it = pending_.find(s.get());
    if (it == pending_.end() || !it->second.hold || it->second.hold.get() == own) continue;
    if (std::find(others.begin(), others.end(), it->second.hold) == others.end()) others.push_back(it->second.hold);
  }
  // (`others` is not the last reference to a hold: its rollback job and ended_holds_ are)
  for (const std::shared_ptr<SpeculationHold>& h : others) queue_rollback_locked(h);
}

void OffloadEngine::queue_rollback_locked(const std::shared_ptr<SpeculationHold>& h) {
  EngineJob job;
  job.name = "superchip::rollback";
  job.owner = h->owner();
  job.touched = h->storages;
  job.run = [h] { h->rollback(); };
  wrap(job);
  stats_[h->owner()].rollbacks_on_read += 1;
  submit_locked(std::move(job));
  drop_hold_locked(h.get());
}

uint64_t OffloadEngine::submit(EngineJob job) {
  release_finished();
  wrap(job);
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    roll_back_other_holds_locked(job, nullptr);
    ticket = submit_locked(std::move(job));
  }
  work_cv_.notify_one();
  return ticket;
}

uint64_t OffloadEngine::submit_replacing_hold(EngineJob job, const SpeculationHold* hold) {
  release_finished();
  wrap(job);
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    roll_back_other_holds_locked(job, hold);
    ticket = submit_locked(std::move(job));
    drop_hold_locked(hold);
  }
  work_cv_.notify_one();
  return ticket;
}

void OffloadEngine::worker_loop() {
  t_on_worker = true;
  if (WorkerStart start = worker_start_.load(std::memory_order_acquire)) {
    try {
      start();
    } catch (...) {
      // No side stream: the worker's copies queue on the default stream, later but still in order.
    }
  }
  for (;;) {
    std::pair<uint64_t, EngineJob> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr err;
    try {
      // GPU work the job depends on (not counted as optimizer time: the GPU's, not ours).
      for (const auto& e : item.second.ready) e->synchronize();
    } catch (...) {
      err = std::current_exception();
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (!err) item.second.run();
    } catch (...) {
      err = std::current_exception();
    }
    // Its GPU copies (snapshots, strided write-backs) end before the job counts as done, also
    // when it failed part-way: the storages it touched are released to readers below.
    try {
      if (WorkerJobEnd end = job_end_.load(std::memory_order_acquire)) end(item.second.touched);
    } catch (...) {
      if (!err) err = std::current_exception();
    }
    const double secs = seconds_since(t0);
    // The job may have written these: the weight streamer's copies of them are stale (Note
    // [Staged copies and writes] in stream/WeightStreamer.cpp). Outside mu_: the hook's lock
    // is taken before mu_ elsewhere.
    if (auto hook = written_hook_.load(std::memory_order_acquire)) {
      for (const auto& s : item.second.touched) hook(s.get());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (err && std::none_of(errors_.begin(), errors_.end(),
                              [&](const auto& e) { return e.first == item.second.owner; })) {
        errors_.emplace_back(item.second.owner, err);
      }
      if (err) failed_[item.second.owner].push_back(item.first);
      done_upto_ = item.first;
      finish(item.second, secs);
    }
    done_cv_.notify_all();
  }
}

// Under mu_.
void OffloadEngine::finish(EngineJob& job, double seconds) {
  stats_[job.owner].optimizer_seconds += seconds;
  for (const auto& s : job.touched) {
    auto it = pending_.find(s.get());
    if (it == pending_.end()) continue;
    if (--it->second.jobs == 0 && !it->second.hold) {
      pending_.erase(it);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }
  // The closure (and `touched`, `keep`) go whole to finished_: Note [Engine and the GIL].
  finished_.push_back(std::move(job));
  has_finished_.store(true, std::memory_order_release);
}

OffloadEngine::Failures OffloadEngine::take_failures(int64_t owner) {
  std::lock_guard<std::mutex> lock(mu_);
  Failures f;
  auto it = failed_.find(owner);
  if (it != failed_.end()) {
    f.tickets = std::move(it->second);
    failed_.erase(it);
  }
  f.done_upto = done_upto_;
  return f;
}

std::exception_ptr OffloadEngine::take_error(int64_t owner) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = errors_.begin(); it != errors_.end(); ++it) {
    if (it->first == owner) {
      std::exception_ptr err = it->second;
      errors_.erase(it);
      return err;
    }
  }
  return nullptr;
}

void OffloadEngine::release_finished() {
  if (t_on_worker || !has_finished_.load(std::memory_order_acquire)) return;
  std::vector<EngineJob> done;
  std::vector<std::shared_ptr<SpeculationHold>> holds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done.swap(finished_);
    holds.swap(ended_holds_);
    has_finished_.store(false, std::memory_order_release);
  }
  // `done` and `holds` drop their tensors here, on the caller's thread, with no lock held.
}

void OffloadEngine::wait(uint64_t ticket, int64_t owner, bool raise_errors) {
  TORCH_CHECK(!t_on_worker, "superchip: internal error: the engine worker waited for itself");
  const auto t0 = std::chrono::steady_clock::now();
  bool waited = false;
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (done_upto_ < ticket) {
      waited = true;
      RECORD_FUNCTION("superchip::wait", std::vector<c10::IValue>());
      done_cv_.wait(lock, [&] { return done_upto_ >= ticket; });
    }
    if (waited && owner != kNoOwner) stats_[owner].exposed_seconds += seconds_since(t0);
    if (raise_errors && !errors_.empty()) {
      err = errors_.front().second;
      errors_.erase(errors_.begin());
    }
  }
  release_finished();
  if (err) std::rethrow_exception(err);
}

void OffloadEngine::synchronize(bool charge_exposed, bool raise_errors) {
  uint64_t last;
  int64_t owner = kNoOwner;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = next_ticket_ - 1;
    // The last job's owner, also when that job is running (no longer queued): charging no one
    // then, as this did, lost the wait of a synchronize() that met a running step.
    if (charge_exposed) owner = last_owner_;
  }
  wait(last, owner, raise_errors);
}

void OffloadEngine::wait_for_storage(const c10::StorageImpl* s) {
  if (active_.load(std::memory_order_acquire) == 0) {
    if (has_finished_.load(std::memory_order_relaxed)) release_finished();
    return;
  }
  if (t_on_worker) return;
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(s);
    if (it == pending_.end()) return;
    const int64_t owner = it->second.owner;
    if (std::shared_ptr<SpeculationHold> h = it->second.hold) {
      // A reader before step(): the plain run shows the unstepped values. The hold becomes a
      // rollback job over the same storages, atomically, so no reader sees them in between.
      queue_rollback_locked(h);
      work_cv_.notify_one();
    }
    RECORD_FUNCTION("superchip::wait", std::vector<c10::IValue>());
    done_cv_.wait(lock, [&] {
      auto e = pending_.find(s);
      return e == pending_.end() || (e->second.jobs == 0 && !e->second.hold);
    });
    stats_[owner].exposed_seconds += seconds_since(t0);
  }
  release_finished();
}

void OffloadEngine::prepare_fork() {
  std::unique_lock<std::mutex> lock(mu_);
  // Every job has run, its written hook included (it runs before done_upto_ moves). Holds stay:
  // they are bytes at rest, and the child's worker rolls them back if a reader asks.
  done_cv_.wait(lock, [&] { return done_upto_ + 1 == next_ticket_; });
  lock.release();  // mu_ stays locked until after_fork(): no job is queued meanwhile
}

void OffloadEngine::after_fork(bool child) {
  if (child) {
    // The worker does not exist in the child, and a waiter the condition variables may still
    // count never wakes: fresh ones, and a worker started by the next job. The old handle is
    // dropped without join (there is no thread to join).
    new (&work_cv_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    new (&worker_) std::thread();
  }
  mu_.unlock();
}

void OffloadEngine::set_written_hook(WrittenHook hook) { written_hook_.store(hook, std::memory_order_release); }

void OffloadEngine::set_gpu_order(ReadyEvents ready, WorkerStart worker_start, WorkerJobEnd job_end) {
  ready_events_.store(ready, std::memory_order_release);
  worker_start_.store(worker_start, std::memory_order_release);
  job_end_.store(job_end, std::memory_order_release);
}

bool OffloadEngine::is_pending(const c10::StorageImpl* s) {
  if (active_.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.count(s) != 0;
}

void OffloadEngine::hold(std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages,
                         std::shared_ptr<SpeculationHold> hold) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : storages) {
    Entry& e = pending_[s.get()];
    if (e.jobs == 0 && !e.hold) active_.fetch_add(1, std::memory_order_relaxed);
    e.hold = hold;
    e.owner = hold->owner();
  }
  hold->storages = std::move(storages);
}

// Under mu_: the hold's storages stop being speculative; an entry no job uses any more goes.
void OffloadEngine::drop_hold_locked(const SpeculationHold* hold) {
  for (const auto& s : hold->storages) {
    auto it = pending_.find(s.get());
    if (it == pending_.end() || it->second.hold.get() != hold) continue;
    // Possibly the last reference: released later, outside the lock (Note [Engine and the GIL]).
    ended_holds_.push_back(std::move(it->second.hold));
    has_finished_.store(true, std::memory_order_release);
    if (it->second.jobs == 0) {
      pending_.erase(it);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }
}

OwnerStats OffloadEngine::stats(int64_t owner) {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_[owner];
}

void OffloadEngine::add_exposed(int64_t owner, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_[owner].exposed_seconds += seconds;
}

}  // namespace superchip
