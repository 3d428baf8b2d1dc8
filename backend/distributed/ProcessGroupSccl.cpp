#include "backend/distributed/ProcessGroupSccl.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <mutex>
#include <utility>

#include "backend/native/Forward.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/StorageLease.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/WriteWatch.h"

namespace superchip {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

bool is_superchip(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
}

// A CPU tensor over the bytes of superchip tensor `t` (host tier), keeping its storage alive.
at::Tensor host_alias(const at::Tensor& t) {
  c10::Storage keep = t.storage();
  char* base = static_cast<char*>(keep.mutable_data()) + t.storage_offset() * t.element_size();
  return at::for_blob(base, t.sizes())
      .strides(t.strides())
      .deleter([keep](void*) mutable { keep = c10::Storage(); })
      .options(at::TensorOptions().dtype(t.dtype()).device(c10::kCPU))
      .make_tensor();
}

// Note [Staging for NCCL]
// With the CUDA executor, hbm-tier operands are aliased as CUDA tensors and NCCL reads and
// writes them in place. NCCL cannot use host memory (the host tier, and plain CPU tensors),
// so such an operand is copied into a device buffer on the current stream before the
// collective (NCCL's stream waits for it) and, when the collective writes it, copied back
// when the inner work completes (the callback runs on streams that wait for NCCL's events).
// With the CPU executor Gloo reads every tier in place: nothing is staged.

// The executor-side view of one collective's operands, and what must happen at completion.
class Operands {
 public:
  Operands(bool stage_host, std::string what) : stage_host_(stage_host), what_(std::move(what)) {}

  at::Tensor in(const at::Tensor& t) { return convert(t, /*written=*/false); }
  at::Tensor out(const at::Tensor& t) { return convert(t, /*written=*/true); }
  std::vector<at::Tensor> in(const std::vector<at::Tensor>& ts) { return convert(ts, false); }
  std::vector<at::Tensor> out(const std::vector<at::Tensor>& ts) { return convert(ts, true); }
  std::vector<std::vector<at::Tensor>> in(const std::vector<std::vector<at::Tensor>>& ts) {
    return convert(ts, false);
  }
  std::vector<std::vector<at::Tensor>> out(const std::vector<std::vector<at::Tensor>>& ts) {
    return convert(ts, true);
  }

  std::vector<StorageLease> leases;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (destination, staged buffer)
  std::vector<c10::Device> devices;                          // superchip devices touched

 private:
  at::Tensor convert(const at::Tensor& t, bool written) {
    if (!t.defined()) return t;
    const bool superchip = is_superchip(t);
    if (superchip) {
      // A collective that writes a parameter is a write its optimizer must see (runtime/WriteWatch.h).
      if (written) note_write(t.storage().unsafeGetStorageImpl());
      leases.emplace_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
                              t.storage().unsafeGetStorageImpl()),
                          what_, written);
      const c10::Device d = t.device();
      bool seen = false;
      for (const c10::Device& x : devices) seen |= x == d;
      if (!seen) devices.push_back(d);
    }
    if (!stage_host_) {
      if (superchip) return executor_alias(t);
      TORCH_CHECK(t.device().is_cpu(), what_, " on the sccl backend: got a tensor on ", t.device(),
                  "; it serves superchip tensors (and cpu ones). Move it with .to('superchip').");
      return t;
    }
    // CUDA executor.
    if (superchip && storage_tier(*t.storage().unsafeGetStorageImpl()) == Tier::kHbm) {
      return executor_alias(t);
    }
    if (!superchip && t.device().is_cuda()) return t;
    TORCH_CHECK(superchip || t.device().is_cpu(), what_, " on the sccl backend: got a tensor on ",
                t.device(), "; it serves superchip tensors (and cpu and cuda ones). Move it with .to('superchip').");
    const at::Tensor host = superchip ? host_alias(t) : t;
    const c10::DeviceIndex index = superchip ? t.device().index() : current_device();
    at::Tensor staged = at::empty(t.sizes(), t.options().device(executor_device(index)));
    staged.copy_(host, /*non_blocking=*/true);
    if (written) copy_back.emplace_back(host, staged);
    return staged;
  }

  std::vector<at::Tensor> convert(const std::vector<at::Tensor>& ts, bool written) {
    std::vector<at::Tensor> r;
    r.reserve(ts.size());
    for (const at::Tensor& t : ts) r.push_back(convert(t, written));
    return r;
  }

  std::vector<std::vector<at::Tensor>> convert(const std::vector<std::vector<at::Tensor>>& ts,
                                               bool written) {
    std::vector<std::vector<at::Tensor>> r;
    r.reserve(ts.size());
    for (const auto& l : ts) r.push_back(convert(l, written));
    return r;
  }

  bool stage_host_;
  std::string what_;
};

// ---- WorkSccl: one or more inner works seen as one, completing with the caller's tensors ----

class WorkSccl final : public c10d::Work {
 public:
  WorkSccl(int rank, c10d::OpType type, std::vector<WorkPtr> inner, Operands ops,
           std::vector<at::Tensor> results, bool device_future)
      : c10d::Work(rank, type),
        inner_(std::move(inner)),
        leases_(std::move(ops.leases)),
        copy_back_(std::move(ops.copy_back)),
        results_(std::move(results)),
        leases_until_done_(device_future),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()),
            device_future ? ops.devices : std::vector<c10::Device>{})) {}

  // Hooks completion to the inner futures; the works without one (Gloo's send/recv) complete
  // through wait() or isCompleted().
  void start() {
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (const WorkPtr& w : inner_) {
      c10::intrusive_ptr<c10::ivalue::Future> f;
      try {
        f = w->getFuture();
      } catch (const std::exception&) {
      }
      if (f) futures.push_back(std::move(f));
      else ++unobserved_;
    }
    {
      std::lock_guard<std::mutex> g(mutex_);
      pending_ = futures.size();
    }
    if (futures.empty() && unobserved_ == 0) {
      finish_once(nullptr);
      return;
    }
    for (auto& f : futures) {
      auto self = c10::intrusive_ptr<WorkSccl>::reclaim_copy(this);
      f->addCallback([self](c10::ivalue::Future& done) {
        self->future_done(done.hasError() ? done.exception_ptr() : nullptr);
      });
    }
  }

  bool isCompleted() override {
    {
      std::lock_guard<std::mutex> g(mutex_);
      if (finished_ && !leases_until_done_) return true;
      if (pending_ > 0) return false;
    }
    for (const WorkPtr& w : inner_) {
      if (!w->isCompleted()) return false;
    }
    release_leases();
    std::exception_ptr err;
    for (const WorkPtr& w : inner_) {
      if (!w->isSuccess()) err = w->exception();
    }
    finish_once(err);
    return true;
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> g(mutex_);
    return finished_ && !error_;
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> g(mutex_);
    return error_;
  }

  int sourceRank() const override { return inner_.at(0)->sourceRank(); }
  std::vector<at::Tensor> result() override { return results_; }

  void synchronize() override {
    for (const WorkPtr& w : inner_) w->synchronize();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::exception_ptr err;
    for (const WorkPtr& w : inner_) {
      try {
        w->wait(timeout);
      } catch (...) {
        err = std::current_exception();
        break;
      }
    }
    if (!err) {
      // Inner futures complete before their works wake waiters, but callbacks of other
      // threads may still be running: wait for them.
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return pending_ == 0 || finished_; });
    }
    finish_once(err);
    release_leases();
    std::lock_guard<std::mutex> g(mutex_);
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  void abort() override {
    for (const WorkPtr& w : inner_) w->abort();
  }

  void release_leases() {
    std::vector<StorageLease> dead;
    {
      std::lock_guard<std::mutex> g(mutex_);
      dead.swap(leases_);
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  void future_done(std::exception_ptr err) {
    bool last = false;
    {
      std::lock_guard<std::mutex> g(mutex_);
      if (err && !first_error_) first_error_ = err;
      last = --pending_ == 0;
      if (last) err = first_error_;
    }
    cv_.notify_all();
    if (last && unobserved_ == 0) finish_once(err);
  }

  // Runs once: copies staged results back, releases the leases, completes the future.
  void finish_once(std::exception_ptr err) {
    {
      std::lock_guard<std::mutex> g(mutex_);
      if (finished_ || finishing_) return;
      finishing_ = true;
    }
    if (!err) {
      try {
        for (auto& [dst, staged] : copy_back_) dst.copy_(staged, /*non_blocking=*/false);
      } catch (...) {
        err = std::current_exception();
      }
    }
    copy_back_.clear();
    if (!leases_until_done_) release_leases();
    {
      std::lock_guard<std::mutex> g(mutex_);
      error_ = err;
      finished_ = true;
    }
    cv_.notify_all();
    finish(err);
    if (err) {
      future_->setErrorIfNeeded(err);
    } else {
      future_->markCompleted(c10::IValue(results_));
    }
  }

  std::vector<WorkPtr> inner_;
  std::vector<StorageLease> leases_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;
  std::vector<at::Tensor> results_;
  // Note [Leases and device completion]: Gloo's future completes when the bytes are final, so
  // the leases go with it. NCCL's completes once the collective is queued on its stream: the
  // leases then stay until the work is known to be done (wait(), isCompleted() true, or the
  // Work is destroyed).
  bool leases_until_done_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  size_t pending_ = 0;      // inner futures not completed yet
  size_t unobserved_ = 0;   // inner works without a future
  bool finishing_ = false;
  bool finished_ = false;
  std::exception_ptr first_error_;
  std::exception_ptr error_;
};

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<at::Tensor> r;
  for (const auto& l : ts) r.insert(r.end(), l.begin(), l.end());
  return r;
}

bool not_supported(const c10::Error& e) {
  return std::string(e.what()).find("does not support") != std::string::npos;
}

}  // namespace

// ---- ProcessGroupSccl ----

ProcessGroupSccl::ProcessGroupSccl(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size,
                                   std::chrono::milliseconds timeout, InnerSplitOptionsFn split_options)
    : c10d::Backend(rank, size),
      stage_host_(executor() == Executor::kCuda),
      inner_(std::move(inner)),
      options_(c10::make_intrusive<SccOptions>(timeout)),
      split_options_(std::move(split_options)) {
  TORCH_CHECK(inner_, "ProcessGroupSccl: the inner process group is missing.");
  TORCH_CHECK(inner_->getRank() == rank && inner_->getSize() == size,
              "ProcessGroupSccl: the inner process group has rank ", inner_->getRank(), " of ",
              inner_->getSize(), ", expected rank ", rank, " of ", size, ".");
}

void ProcessGroupSccl::setTimeout(std::chrono::milliseconds timeout) {
  inner_->setTimeout(timeout);
  options_->timeout = timeout;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupSccl::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                         const std::vector<int>& ranks,
                                                         const c10::intrusive_ptr<Options>& opts) {
  TORCH_CHECK(split_options_, "The sccl group cannot be split: it was built without a way to "
              "make options for its inner group. Create sub-groups with dist.new_group().");
  const Options& o = opts ? *opts : *options_;
  c10::intrusive_ptr<c10d::Backend> child = inner_->split(store, ranks, split_options_(inner_, o));
  if (!child) return nullptr;  // this rank is not in `ranks`
  auto pg = c10::make_intrusive<ProcessGroupSccl>(child, child->getRank(), child->getSize(),
                                                  o.timeout, split_options_);
  pg->options_->group_name = o.group_name;
  pg->options_->group_desc = o.group_desc;
  return pg;
}

namespace {

WorkPtr wrap(int rank, c10d::OpType type, std::vector<WorkPtr> inner, Operands ops,
             std::vector<at::Tensor> results, bool device_future) {
  auto work = c10::make_intrusive<WorkSccl>(rank, type, std::move(inner), std::move(ops),
                                            std::move(results), device_future);
  work->start();
  return work;
}

}  // namespace

#define SCCL_WRAP(type, ops, inner_call, results) \
  wrap(getRank(), c10d::OpType::type, {inner_call}, std::move(ops), results, stage_host_)

WorkPtr ProcessGroupSccl::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  Operands ops(stage_host_, "broadcast");
  auto t = ops.out(tensors);
  return SCCL_WRAP(BROADCAST, ops, inner_->broadcast(t, opts), tensors);
}

WorkPtr ProcessGroupSccl::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  Operands ops(stage_host_, "allreduce");
  auto t = ops.out(tensors);
  return SCCL_WRAP(ALLREDUCE, ops, inner_->allreduce(t, opts), tensors);
}

WorkPtr ProcessGroupSccl::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                              const c10d::AllreduceCoalescedOptions& opts) {
  Operands ops(stage_host_, "allreduce_coalesced");
  auto t = ops.out(tensors);
  return SCCL_WRAP(ALLREDUCE_COALESCED, ops, inner_->allreduce_coalesced(t, opts), tensors);
}

WorkPtr ProcessGroupSccl::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  Operands ops(stage_host_, "reduce");
  auto t = ops.out(tensors);
  return SCCL_WRAP(REDUCE, ops, inner_->reduce(t, opts), tensors);
}

WorkPtr ProcessGroupSccl::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                    std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  Operands ops(stage_host_, "allgather");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  return SCCL_WRAP(ALLGATHER, ops, inner_->allgather(o, i, opts), flat(outputs));
}

WorkPtr ProcessGroupSccl::_allgather_base(at::Tensor& output, at::Tensor& input,
                                          const c10d::AllgatherOptions& opts) {
  Operands ops(stage_host_, "all_gather_into_tensor");
  auto o = ops.out(output);
  auto i = ops.in(input);
  return SCCL_WRAP(_ALLGATHER_BASE, ops, inner_->_allgather_base(o, i, opts),
                   std::vector<at::Tensor>{output});
}

WorkPtr ProcessGroupSccl::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                              std::vector<at::Tensor>& inputs,
                                              const c10d::AllgatherOptions& opts) {
  Operands ops(stage_host_, "allgather_coalesced");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  return SCCL_WRAP(ALLGATHER_COALESCED, ops, inner_->allgather_coalesced(o, i, opts), flat(outputs));
}

WorkPtr ProcessGroupSccl::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "allgather_into_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs; pass one output per input.");
  Operands ops(stage_host_, "allgather_into_tensor_coalesced");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  std::vector<WorkPtr> works;
  try {
    works.push_back(inner_->allgather_into_tensor_coalesced(o, i, opts));
  } catch (const c10::Error& e) {
    if (!not_supported(e)) throw;
    // The inner group lacks the coalesced form: one collective per pair, in order.
    for (size_t k = 0; k < o.size(); ++k) works.push_back(inner_->_allgather_base(o[k], i[k], opts));
  }
  return wrap(getRank(), c10d::OpType::COALESCED, std::move(works), std::move(ops), outputs, stage_host_);
}

WorkPtr ProcessGroupSccl::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                 std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  Operands ops(stage_host_, "gather");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  return SCCL_WRAP(GATHER, ops, inner_->gather(o, i, opts), flat(outputs));
}

WorkPtr ProcessGroupSccl::scatter(std::vector<at::Tensor>& outputs,
                                  std::vector<std::vector<at::Tensor>>& inputs,
                                  const c10d::ScatterOptions& opts) {
  Operands ops(stage_host_, "scatter");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  return SCCL_WRAP(SCATTER, ops, inner_->scatter(o, i, opts), outputs);
}

WorkPtr ProcessGroupSccl::reduce_scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ReduceScatterOptions& opts) {
  Operands ops(stage_host_, "reduce_scatter");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  return SCCL_WRAP(REDUCE_SCATTER, ops, inner_->reduce_scatter(o, i, opts), outputs);
}

WorkPtr ProcessGroupSccl::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                               const c10d::ReduceScatterOptions& opts) {
  Operands ops(stage_host_, "reduce_scatter_tensor");
  auto o = ops.out(output);
  auto i = ops.in(input);
  return SCCL_WRAP(_REDUCE_SCATTER_BASE, ops, inner_->_reduce_scatter_base(o, i, opts),
                   std::vector<at::Tensor>{output});
}

WorkPtr ProcessGroupSccl::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "reduce_scatter_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs; pass one output per input.");
  Operands ops(stage_host_, "reduce_scatter_tensor_coalesced");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  std::vector<WorkPtr> works;
  try {
    works.push_back(inner_->reduce_scatter_tensor_coalesced(o, i, opts));
  } catch (const c10::Error& e) {
    if (!not_supported(e)) throw;
    for (size_t k = 0; k < o.size(); ++k) works.push_back(inner_->_reduce_scatter_base(o[k], i[k], opts));
  }
  return wrap(getRank(), c10d::OpType::COALESCED, std::move(works), std::move(ops), outputs, stage_host_);
}

WorkPtr ProcessGroupSccl::alltoall_base(at::Tensor& output, at::Tensor& input,
                                        std::vector<int64_t>& output_splits,
                                        std::vector<int64_t>& input_splits,
                                        const c10d::AllToAllOptions& opts) {
  Operands ops(stage_host_, "all_to_all_single");
  auto o = ops.out(output);
  auto i = ops.in(input);
  return SCCL_WRAP(ALLTOALL_BASE, ops, inner_->alltoall_base(o, i, output_splits, input_splits, opts),
                   std::vector<at::Tensor>{output});
}

WorkPtr ProcessGroupSccl::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                   const c10d::AllToAllOptions& opts) {
  Operands ops(stage_host_, "all_to_all");
  auto o = ops.out(outputs);
  auto i = ops.in(inputs);
  return SCCL_WRAP(ALLTOALL, ops, inner_->alltoall(o, i, opts), outputs);
}

WorkPtr ProcessGroupSccl::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  Operands ops(stage_host_, "send");
  auto t = ops.in(tensors);
  return SCCL_WRAP(SEND, ops, inner_->send(t, dst, tag), tensors);
}

WorkPtr ProcessGroupSccl::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  Operands ops(stage_host_, "recv");
  auto t = ops.out(tensors);
  return SCCL_WRAP(RECV, ops, inner_->recv(t, src, tag), tensors);
}

WorkPtr ProcessGroupSccl::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  Operands ops(stage_host_, "recv");
  auto t = ops.out(tensors);
  return SCCL_WRAP(RECVANYSOURCE, ops, inner_->recvAnysource(t, tag), tensors);
}

WorkPtr ProcessGroupSccl::barrier(const c10d::BarrierOptions& opts) {
  c10d::BarrierOptions inner_opts = opts;
  if (opts.device.has_value() && opts.device->type() == c10::DeviceType::PrivateUse1) {
    // The inner group knows executor devices only (Gloo ignores the device, NCCL needs cuda:i).
    inner_opts.device = stage_host_ ? std::optional<c10::Device>(executor_device(opts.device->index()))
                                    : std::nullopt;
  }
  Operands ops(stage_host_, "barrier");
  return SCCL_WRAP(BARRIER, ops, inner_->barrier(inner_opts), std::vector<at::Tensor>{});
}

#undef SCCL_WRAP

}  // namespace superchip
