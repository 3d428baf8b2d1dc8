#include "backend/stream/StagingCopier.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/MemoryManager.h"
#include "backend/runtime/Runtime.h"

#ifdef SUPERCHIP_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "allocator/Backing.h"  // SUPERCHIP_CUDA_CHECK, DeviceScope
#endif

// Note [Copy stream ordering]
// With the CUDA executor a staged copy is written on a copy stream of our own and read by
// kernels on the current (compute) stream. Three hazards, three events:
//  1. The copy must not read the host bytes before the kernels that write them (an optimizer
//     step on the GPU, an in-place update) have run, nor overwrite an arena block that earlier
//     kernels still read: issue() records an event on the compute stream and makes the copy
//     stream wait for it, so a copy starts only once everything enqueued before it has run.
//     (Writes the CPU makes are covered by the streamer: note_written() drops a copy begun
//     before the write ends, and prefetch skips weights with an engine job pending.)
//  2. A kernel must not read the block before the copy ends: make_visible() makes the compute
//     stream wait for the copy's event.
//  3. A block must not be reused (by the compute stream, which owns hbm's caching allocator
//     order, or by a later copy) before the copy into it ends, also when no kernel read it:
//     before_release() makes the compute stream wait for that copy.
// None of them blocks the CPU. The compute stream's handle comes from c10::Stream::native_handle
// (torch with that API); without it only the default stream (the legacy stream, handle 0,
// shared by every runtime in the process) can be ordered, and usable() says so otherwise.

namespace superchip {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void add(std::atomic<double>& a, double x) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + x, std::memory_order_relaxed)) {
  }
}

// ---- emulated: a copier thread ----

class ThreadCopier final : public StagingCopier {
 public:
  explicit ThreadCopier(MemoryManager& mm) : mm_(mm) {}

  struct HostTicket final : Ticket {
    bool done = false;  // under mu_
  };

  bool usable() override { return true; }

  std::shared_ptr<Ticket> issue(void* dst, const void* src, size_t n) override {
    auto t = std::make_shared<HostTicket>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      queue_.push_back({dst, src, n, t});
    }
    work_cv_.notify_one();
    return t;
  }

  bool make_visible(Ticket& t) override {
    auto& h = static_cast<HostTicket&>(t);
    std::unique_lock<std::mutex> lock(mu_);
    if (h.done) return false;
    done_cv_.wait(lock, [&] { return h.done; });
    return true;
  }

  void copy_now(void* dst, const void* src, size_t n) override {
    const double t0 = now_seconds();
    mm_.copy(dst, src, n);
    add(seconds_, now_seconds() - t0);
    add(bytes_, static_cast<double>(n));
  }

  void before_release(Ticket* t) noexcept override {
    if (t != nullptr) make_visible(*t);  // the thread may still be writing the block
  }

  double seconds() override { return seconds_.load(std::memory_order_relaxed); }
  double measured_bytes() override { return bytes_.load(std::memory_order_relaxed); }
  const char* kind() const noexcept override { return "thread"; }

  void prepare_fork() override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    lock.release();  // until after_fork()
  }

  void after_fork(bool child) override {
    if (child) {
      // No copier thread in the child (see OffloadEngine::after_fork): fresh condition
      // variables, and a thread started by the next copy.
      new (&work_cv_) std::condition_variable();
      new (&done_cv_) std::condition_variable();
      new (&thread_) std::thread();
    }
    mu_.unlock();
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    size_t n;
    std::shared_ptr<HostTicket> ticket;
  };

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      copy_now(job.dst, job.src, job.n);
      {
        std::lock_guard<std::mutex> lock(mu_);
        job.ticket->done = true;
        busy_ = false;
      }
      done_cv_.notify_all();
    }
  }

  MemoryManager& mm_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Job> queue_;
  bool busy_ = false;  // under mu_: the thread is copying a job it took off queue_
  std::atomic<double> seconds_{0.0};
  std::atomic<double> bytes_{0.0};
  std::thread thread_;  // never joined: the copier lives as long as the process (a new one in
                        // a forked child)
};

#ifdef SUPERCHIP_HAVE_CUDA

// ---- CUDA: a copy stream and events (Note [Copy stream ordering]) ----


class CudaCopier final : public StagingCopier {
 public:
  explicit CudaCopier(c10::DeviceIndex device) : device_(device) {
    DeviceScope g(device_);
    SUPERCHIP_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  }
  // The stream and events outlive every use: the streamer (and so its copier) is never destroyed.

  struct CudaTicket final : Ticket {
    cudaEvent_t start = nullptr;
    cudaEvent_t end = nullptr;
    size_t n = 0;
    CudaCopier* owner = nullptr;
    ~CudaTicket() override {
      // Time a copy that has ended; either way the events go back to the pool.
      if (cudaEventQuery(end) == cudaSuccess) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, start, end) == cudaSuccess) {
          add(owner->seconds_, ms / 1e3);
          add(owner->bytes_, static_cast<double>(n));
        }
      }
      (void)cudaGetLastError();
      owner->recycle(start, /*timed=*/true);
      owner->recycle(end, /*timed=*/true);
    }
  };

  bool usable() override {
    bool ok = false;
    (void)compute_stream(&ok);
    return ok;
  }

  std::shared_ptr<Ticket> issue(void* dst, const void* src, size_t n) override {
    bool ok = false;
    cudaStream_t compute = compute_stream(&ok);
    TORCH_INTERNAL_ASSERT(ok, "StagingCopier::issue without a usable compute stream");
    DeviceScope g(device_);
    cudaEvent_t ready = event(/*timed=*/false);
    SUPERCHIP_CUDA_CHECK(cudaEventRecord(ready, compute));
    SUPERCHIP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, ready, 0));
    recycle(ready, /*timed=*/false);  // a recorded event may be reused once waited on
    auto t = std::make_shared<CudaTicket>();
    t->owner = this;
    t->n = n;
    t->start = event(/*timed=*/true);
    t->end = event(/*timed=*/true);
    SUPERCHIP_CUDA_CHECK(cudaEventRecord(t->start, copy_stream_));
    SUPERCHIP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, copy_stream_));
    SUPERCHIP_CUDA_CHECK(cudaEventRecord(t->end, copy_stream_));
    return t;
  }

  bool make_visible(Ticket& t) override {
    bool ok = false;
    cudaStream_t compute = compute_stream(&ok);
    DeviceScope g(device_);
    if (!ok) {
      SUPERCHIP_CUDA_CHECK(cudaEventSynchronize(static_cast<CudaTicket&>(t).end));
      return true;
    }
    SUPERCHIP_CUDA_CHECK(cudaStreamWaitEvent(compute, static_cast<CudaTicket&>(t).end, 0));
    return false;
  }

  void copy_now(void* dst, const void* src, size_t n) override {
    bool ok = false;
    cudaStream_t compute = compute_stream(&ok);
    TORCH_INTERNAL_ASSERT(ok, "StagingCopier::copy_now without a usable compute stream");
    DeviceScope g(device_);
    SUPERCHIP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, compute));
  }

  void before_release(Ticket* t) noexcept override {
    if (t == nullptr) return;
    try {
      make_visible(*t);
    } catch (const std::exception&) {
      // The device is unusable: nothing will reuse the block.
    }
  }

  double seconds() override { return seconds_.load(std::memory_order_relaxed); }
  double measured_bytes() override { return bytes_.load(std::memory_order_relaxed); }
  const char* kind() const noexcept override { return "cuda_stream"; }

 private:
  // The current stream of our device as a cudaStream_t; *ok false when it cannot be had.
  cudaStream_t compute_stream(bool* ok) {
    const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    const c10::Device dev(c10::DeviceType::CUDA, device_);
    const c10::Stream s = guard->getStream(dev);
#ifdef SUPERCHIP_TORCH_HAS_STREAM_NATIVE_HANDLE
    try {
      void* h = s.native_handle();
      // One compute stream, the first that reads a staged copy: a block is reused once that
      // stream has passed its readers (issue() orders the next copy after it); a kernel on
      // another stream could still be reading when the copy overwrote it, so other streams
      // read weights in place (their releases wait for the copy on the CPU: make_visible).
      c10::StreamId none = kNoStream;
      stream_id_.compare_exchange_strong(none, s.id());
      *ok = stream_id_.load() == s.id();
      return static_cast<cudaStream_t>(h);
    } catch (const c10::Error&) {
      // This torch's CUDA guard does not implement it: fall through to the default stream.
    }
#endif
    *ok = s == guard->getDefaultStream(dev);
    return nullptr;  // the legacy default stream, which torch's default stream is
  }

  cudaEvent_t event(bool timed) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& pool = timed ? timed_pool_ : plain_pool_;
      if (!pool.empty()) {
        cudaEvent_t e = pool.back();
        pool.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    SUPERCHIP_CUDA_CHECK(cudaEventCreateWithFlags(&e, timed ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }

  void recycle(cudaEvent_t e, bool timed) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    (timed ? timed_pool_ : plain_pool_).push_back(e);
  }

  static constexpr c10::StreamId kNoStream = std::numeric_limits<c10::StreamId>::min();
  std::atomic<c10::StreamId> stream_id_{kNoStream};  // the compute stream copies are ordered with
  c10::DeviceIndex device_;
  cudaStream_t copy_stream_ = nullptr;
  std::mutex mu_;
  std::vector<cudaEvent_t> timed_pool_;
  std::vector<cudaEvent_t> plain_pool_;
  std::atomic<double> seconds_{0.0};
  std::atomic<double> bytes_{0.0};
};

#endif  // SUPERCHIP_HAVE_CUDA

}  // namespace

std::unique_ptr<StagingCopier> make_staging_copier(MemoryManager& mm, c10::DeviceIndex device) {
#ifdef SUPERCHIP_HAVE_CUDA
  if (executor() == Executor::kCuda) return std::make_unique<CudaCopier>(device);
#endif
  (void)device;
  return std::make_unique<ThreadCopier>(mm);
}

}  // namespace superchip
