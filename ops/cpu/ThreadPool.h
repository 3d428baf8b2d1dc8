// A fixed pool of worker threads for the CPU optimizer step, optionally pinned one per CPU id
// (the backend passes the GPU-local NUMA node's cores from hwloc).
// parallel_for(n, grain, fn) splits [0, n) into at most num_threads() contiguous chunks of at
// least `grain` indices each (one chunk when n < 2 * grain), calls fn(begin, end) once per
// chunk and returns when all are done. Chunk bounds depend only on (n, grain, num_threads()),
// never on timing. A single chunk runs on the calling thread; so does a call made from inside
// a worker (nested parallelism runs serially instead of deadlocking).
// Errors: if fn throws, chunks not yet started are skipped and the first exception is rethrown
// to the caller once every started chunk has finished; the pool stays usable.
// Thread-safety: parallel_for may be called from several threads; calls run one at a time.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace superchip::ops {

class ThreadPool {
 public:
  using RangeFn = std::function<void(int64_t begin, int64_t end)>;

  // num_threads >= 1 workers. With cpu_ids non-empty, worker i is pinned to
  // cpu_ids[i % cpu_ids.size()] (sched_setaffinity); an id the OS refuses throws
  // std::system_error naming it, an id < 0 throws std::invalid_argument.
  explicit ThreadPool(int num_threads, std::vector<int> cpu_ids = {});
  ~ThreadPool();  // joins the workers; must not be called while a parallel_for runs
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const noexcept { return num_threads_; }
  const std::vector<int>& cpu_ids() const noexcept { return cpu_ids_; }

  // n >= 0 (0 calls nothing), grain >= 1; see the file comment.
  void parallel_for(int64_t n, int64_t grain, const RangeFn& fn);

 private:
  struct Job;
  void worker_main(int index);
  static void run_chunks(Job& job);

  const int num_threads_;    // fixed before any worker starts (workers_ grows meanwhile)
  std::vector<int> cpu_ids_;
  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  Job* job_ = nullptr;    // guarded by mu_
  uint64_t generation_ = 0;
  int active_ = 0;        // workers still holding job_
  bool stop_ = false;
  std::vector<int> pin_errno_;  // per worker, set before the constructor returns
  int started_ = 0;
};

}  // namespace superchip::ops
