#include "ops/cpu/ThreadPool.h"

#include <sched.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

namespace superchip::ops {
namespace {
thread_local bool t_in_worker = false;
}  // namespace

struct ThreadPool::Job {
  const RangeFn* fn = nullptr;
  int64_t n = 0;
  int64_t chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::exception_ptr err;

  int64_t begin(int64_t c) const { return n * c / chunks; }
};

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpu_ids)
    : num_threads_(num_threads), cpu_ids_(std::move(cpu_ids)) {
  if (num_threads < 1) {
    throw std::invalid_argument("ThreadPool: num_threads must be >= 1, got " +
                                std::to_string(num_threads));
  }
  for (int id : cpu_ids_) {
    if (id < 0 || id >= CPU_SETSIZE) {
      throw std::invalid_argument("ThreadPool: cpu id " + std::to_string(id) + " is out of range [0, " +
                                  std::to_string(CPU_SETSIZE) + ")");
    }
  }
  pin_errno_.assign(static_cast<size_t>(num_threads), 0);
  workers_.reserve(static_cast<size_t>(num_threads));
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back(&ThreadPool::worker_main, this, i);
  // Wait for every worker to pin itself so that a refused CPU id is reported here.
  int bad = -1;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return started_ == num_threads; });
    for (int i = 0; i < num_threads; ++i) {
      if (pin_errno_[static_cast<size_t>(i)] != 0) {
        bad = i;
        break;
      }
    }
  }
  if (bad >= 0) {
    const int err = pin_errno_[static_cast<size_t>(bad)];
    const int cpu = cpu_ids_[static_cast<size_t>(bad) % cpu_ids_.size()];
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw std::system_error(err, std::generic_category(),
                            "ThreadPool: sched_setaffinity(cpu " + std::to_string(cpu) +
                                ") for worker " + std::to_string(bad));
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_main(int index) {
  t_in_worker = true;
  int err = 0;
  if (!cpu_ids_.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu_ids_[static_cast<size_t>(index) % cpu_ids_.size()], &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) err = errno;  // 0: the calling thread
  }
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  pin_errno_[static_cast<size_t>(index)] = err;
  if (++started_ == num_threads()) done_cv_.notify_all();
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    Job* job = job_;
    lock.unlock();
    run_chunks(*job);
    lock.lock();
    // The caller's Job lives on its stack: it may only return once no worker holds it.
    if (--active_ == 0) done_cv_.notify_all();
  }
}

void ThreadPool::run_chunks(Job& job) {
  for (;;) {
    const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.chunks) return;
    if (job.failed.load(std::memory_order_relaxed)) continue;
    try {
      (*job.fn)(job.begin(c), job.begin(c + 1));
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.err_mu);
      if (!job.err) job.err = std::current_exception();
      job.failed.store(true, std::memory_order_relaxed);
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const RangeFn& fn) {
  if (n < 0) throw std::invalid_argument("ThreadPool::parallel_for: n must be >= 0, got " + std::to_string(n));
  if (grain < 1) throw std::invalid_argument("ThreadPool::parallel_for: grain must be >= 1, got " + std::to_string(grain));
  if (n == 0) return;
  int64_t chunks = n / grain;
  if (chunks > num_threads()) chunks = num_threads();
  if (chunks <= 1 || t_in_worker) {
    fn(0, n);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  job.chunks = chunks;
  std::lock_guard<std::mutex> submit(submit_mu_);
  {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &job;
    active_ = num_threads();
    ++generation_;
    work_cv_.notify_all();
    done_cv_.wait(lock, [&] { return active_ == 0; });
    job_ = nullptr;
  }
  if (job.err) std::rethrow_exception(job.err);
}

}  // namespace superchip::ops
