#include "backend/optim/FusedStep.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "allocator/Topology.h"
#include "backend/engine/OffloadEngine.h"
#include "backend/native/Forward.h"
#include "backend/runtime/Runtime.h"
#include "backend/stream/WeightStreamer.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "ops/cpu/ThreadPool.h"
#ifdef SUPERCHIP_HAVE_OPS_CUDA
#include "ops/cuda/FusedOptimCuda.h"
#endif

namespace superchip {
namespace {

// Elements per work item: large enough to amortise scheduling, small enough that every
// thread gets several items on a billion-parameter model; a multiple of 64 bytes of fp32.
constexpr int64_t kChunk = 1 << 16;


ops::DType dtype_of(const at::Tensor& t, const char* what, size_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return ops::DType::kF32;
    case at::kBFloat16: return ops::DType::kBF16;
    case at::kHalf: return ops::DType::kF16;
    default:
      TORCH_CHECK(false, "superchip.optim: ", what, " ", i, " has dtype ", t.scalar_type(),
                  "; the fused optimizer supports float32, bfloat16 and float16. Use torch.optim "
                  "for other dtypes.");
  }
}

// A step run on a caller's thread (overlap=False, tail buckets) reads its operands directly:
// a queued engine job on them finishes first. No-op on the engine worker.
void wait_pending(const at::Tensor& t) {
  if (t.defined() && t.has_storage()) OffloadEngine::get().wait_for_storage(t.storage().unsafeGetStorageImpl());
}

// Note [Kernel results keep the version]
// A step's kernel writes a parameter's bytes directly when it can address them (the CPU
// executor, host-tier parameters) and autograd's version counter does not move. When the
// operand had to be staged (an hbm parameter under the CUDA executor), its write-back copy
// must not move it either: the engine's asynchronous step writes back while the next forward
// runs, so a bump there made that forward's saved weights "modified by an inplace operation"
// in its backward (seen on an H100). Nor may the write-back be a superchip copy_: copy_from
// takes a whole copy in from the CPU for a weight arriving (Note [Batches while streaming] in
// native/Native.cpp) and placed the parameter in host when hbm was past its weights limit, from
// the engine's worker, while the next forward ran (found by review, then reproduced with
// SUPERCHIP_STAGE_HBM_OPERANDS=1 and a small hbm budget). So the bytes are written through the
// parameter's executor alias (copy_through_aliases): same bytes, same stream order, no placement,
// no mark, and the superchip tensor's version counter untouched, as the direct write leaves it.

// Note [Staging hbm operands without a GPU]
// Under the CUDA executor the CPU kernels cannot address hbm, so a step stages hbm operands
// through pinned host copies and writes them back (HostOperand). SUPERCHIP_STAGE_HBM_OPERANDS=1
// makes the CPU executor do the same, so that this path, which only a GPU run reached before
// (where it broke the engine, Note [Kernel results keep the version]), is tested in CI.
bool stage_hbm_operands() {
  static const bool on = [] {
    const char* v = std::getenv("SUPERCHIP_STAGE_HBM_OPERANDS");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

bool host_addressable(const at::Tensor& t) {
  if (t.device().is_cpu()) return true;
  if (t.device().type() != c10::DeviceType::PrivateUse1) return false;
  return executor() == Executor::kCpu || storage_tier(*t.storage().unsafeGetStorageImpl()) == Tier::kHost;
}

// Whether HostOperand stages `t` although the kernel could address it: an hbm operand under
// SUPERCHIP_STAGE_HBM_OPERANDS=1 with the CPU executor (Note [Staging hbm operands without a GPU]).
bool staged_for_emulation(const at::Tensor& t) {
  return stage_hbm_operands() && executor() == Executor::kCpu &&
         t.device().type() == c10::DeviceType::PrivateUse1 &&
         storage_tier(*t.storage().unsafeGetStorageImpl()) == Tier::kHbm;
}

// A host-addressable, contiguous view of `t` for the kernel; write_back() copies kernel
// results into `t` when a staging copy had to be made.
class HostOperand {
 public:
  static constexpr bool kOnHost = true;
  static bool addressable(const at::Tensor& t) { return host_addressable(t); }

  HostOperand(const at::Tensor& t, bool written) : original_(t), written_(written) {
    wait_pending(t);
    const bool direct = host_addressable(t) && !staged_for_emulation(t);
    if (direct && t.is_contiguous()) {
      host_ = t;
    } else if (direct && executor() == Executor::kCpu) {
      host_ = t.contiguous();
      staged_ = true;
    } else {
      host_ = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
      host_.copy_(t);
      staged_ = true;
    }
  }
  void* data() const { return host_.data_ptr(); }
  int64_t staged_bytes() const { return staged_ ? static_cast<int64_t>(host_.nbytes()) : 0; }
  void write_back() {
    if (staged_ && written_) copy_through_aliases(original_, host_);
    // The kernel wrote the bytes directly: a staged copy of this weight is stale.
    if (written_ && original_.device().type() == c10::DeviceType::PrivateUse1) {
      WeightStreamer::get().note_written(original_.storage().unsafeGetStorageImpl());
    }
  }

 private:
  at::Tensor original_;
  at::Tensor host_;
  bool written_;
  bool staged_ = false;
};

// The executor's view of `t` for a step run by ops/cuda (tail buckets): superchip memory of
// either tier (with the CUDA executor, host-tier blocks are pinned and mapped, so kernels
// address them too), made contiguous on the executor when it is not; write_back() copies a
// staged result back, in stream order.
class ExecutorOperand {
 public:
  static constexpr bool kOnHost = false;
  static bool addressable(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

  ExecutorOperand(const at::Tensor& t, bool written) : original_(t), written_(written) {
    wait_pending(t);
    TORCH_CHECK(addressable(t), "superchip.optim: a tail bucket is stepped by the executor, but an operand is on ",
                t.device(), "; tail buckets need superchip parameters and gradients (use tail_buckets=0).");
    // A staging copy in the executor's memory, in the current stream's order, never a block of
    // superchip's pool (Note [The worker's temporaries are the executor's], engine/AdamBucket.cpp).
    exec_ = t.is_contiguous() ? t : executor_alias(t, Access::kRead).contiguous();
    staged_ = !t.is_contiguous();
  }
  void* data() const { return exec_.data_ptr(); }
  void write_back() {
    if (staged_ && written_) copy_through_aliases(original_, exec_);
    if (written_) WeightStreamer::get().note_written(original_.storage().unsafeGetStorageImpl());
  }

 private:
  at::Tensor original_;
  at::Tensor exec_;
  bool written_;
  bool staged_ = false;
};

template <typename Operand>
void check_state(const at::Tensor& s, const at::Tensor& p, const char* what, size_t i) {
  wait_pending(s);
  TORCH_CHECK(s.defined() && s.scalar_type() == at::kFloat && s.numel() == p.numel() && s.is_contiguous() &&
                  Operand::addressable(s),
              "superchip.optim: state '", what, "' of parameter ", i,
              " must be a contiguous float32 tensor with ", p.numel(), " elements in ",
              Operand::kOnHost ? "host-addressable memory" : "superchip memory",
              " (the optimizer creates it; was the state dict edited by hand?).");
}

struct Item {
  size_t tensor;
  int64_t begin;
  int64_t end;
};

std::vector<Item> cut(const std::vector<int64_t>& sizes) {
  std::vector<Item> items;
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t b = 0; b < sizes[i]; b += kChunk) items.push_back({i, b, std::min(sizes[i], b + kChunk)});
  }
  return items;
}

template <typename T>
T* at_offset(void* base, int64_t i) {
  return base ? static_cast<T*>(base) + i : nullptr;
}

const void* at_offset_dtype(const void* base, ops::DType d, int64_t i) {
  const size_t width = d == ops::DType::kF32 ? 4 : 2;
  return static_cast<const char*>(base) + i * static_cast<int64_t>(width);
}

void* at_offset_dtype(void* base, ops::DType d, int64_t i) {
  return base ? const_cast<void*>(at_offset_dtype(static_cast<const void*>(base), d, i)) : nullptr;
}

// With the CUDA executor, kernels that wrote optimizer operands (gradients, state created or
// loaded by forwarded ops, host-tier memory included) may still be running; the CPU kernels
// read those bytes directly, so the devices of the parameters are synchronised first.
void wait_for_executor(const std::vector<at::Tensor>& params) {
  if (executor() != Executor::kCuda) return;
  // The engine's worker waited for the GPU work queued before the job was submitted; a device
  // synchronize here would also wait for what was queued since (Note [Engine jobs and GPU
  // streams] in engine/OffloadEngine.cpp).
  if (OffloadEngine::on_worker()) return;
  std::vector<bool> done(static_cast<size_t>(device_count()), false);
  for (const at::Tensor& p : params) {
    if (p.device().type() != c10::DeviceType::PrivateUse1 || done[p.device().index()]) continue;
    c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->synchronizeDevice(p.device().index());
    done[p.device().index()] = true;
  }
}

// Parameter (fp32 itself, or fp32 master + low-precision copy) and gradient fields, which
// AdamArrays and SgdArrays share; operands that must be staged are kept in `operands`.
template <typename Operand, typename Arrays>
void bind_param_and_grad(Arrays& a, size_t i, const at::Tensor& p, const at::Tensor& grad,
                         const std::optional<at::Tensor>& master, std::vector<Operand>& operands) {
  TORCH_CHECK(grad.numel() == p.numel(), "superchip.optim: gradient of parameter ", i, " has ",
              grad.numel(), " elements, the parameter ", p.numel(), ".");
  a.n = p.numel();
  const ops::DType pd = dtype_of(p, "parameter", i);
  a.grad_dtype = dtype_of(grad, "gradient", i);
  operands.emplace_back(grad, /*written=*/false);
  a.grad = operands.back().data();
  operands.emplace_back(p, /*written=*/true);
  if (pd == ops::DType::kF32) {
    a.param = static_cast<float*>(operands.back().data());
    return;
  }
  TORCH_CHECK(master.has_value(), "superchip.optim: ", p.scalar_type(), " parameter ", i,
              " has no fp32 master weight.");
  check_state<Operand>(*master, p, "master_param", i);
  a.param = master->data_ptr<float>();
  a.param_lowp = operands.back().data();
  a.lowp_dtype = pd;
}

ops::AdamArrays slice(const ops::AdamArrays& a, int64_t begin, int64_t end) {
  ops::AdamArrays s = a;
  s.param = at_offset<float>(a.param, begin);
  s.exp_avg = at_offset<float>(a.exp_avg, begin);
  s.exp_avg_sq = at_offset<float>(a.exp_avg_sq, begin);
  s.max_exp_avg_sq = at_offset<float>(a.max_exp_avg_sq, begin);
  s.grad = at_offset_dtype(a.grad, a.grad_dtype, begin);
  s.param_lowp = at_offset_dtype(a.param_lowp, a.lowp_dtype, begin);
  s.n = end - begin;
  return s;
}

ops::SgdArrays slice(const ops::SgdArrays& a, int64_t begin, int64_t end) {
  ops::SgdArrays s = a;
  s.param = at_offset<float>(a.param, begin);
  s.momentum_buffer = at_offset<float>(a.momentum_buffer, begin);
  s.grad = at_offset_dtype(a.grad, a.grad_dtype, begin);
  s.param_lowp = at_offset_dtype(a.param_lowp, a.lowp_dtype, begin);
  s.n = end - begin;
  return s;
}

template <typename Arrays>
std::vector<Item> items_of(const std::vector<Arrays>& arrays) {
  std::vector<int64_t> sizes;
  sizes.reserve(arrays.size());
  for (const Arrays& a : arrays) sizes.push_back(a.n);
  return cut(sizes);
}

// Cuts every parameter into chunks and runs step(item, chunk) over the pool of `device`'s node.
template <typename Arrays, typename StepFn>
void run_chunked(c10::DeviceIndex device, const std::vector<Arrays>& arrays, const StepFn& step) {
  const std::vector<Item> items = items_of(arrays);
  optimizer_pool(device).parallel_for(static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Item& it = items[k];
      step(it, k, slice(arrays[it.tensor], it.begin, it.end));
    }
  });
}


}  // namespace

namespace {

std::mutex g_pool_mu;
// Leaked: joining its workers at exit would wait for threads a forked child does not have.
ops::ThreadPool* g_pool = nullptr;

}  // namespace

ops::ThreadPool& optimizer_pool(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool == nullptr) {
    const Topology& topo = Topology::get();
    int gpu = -1;
    if (executor() == Executor::kCuda) gpu = executor_device(device < 0 ? current_device() : device).index();
    const NumaNode& node = topo.nodes()[topo.nearest_node(cuda_pci_bus_id(gpu))];
    int threads = static_cast<int>(node.cpus.size());
    if (const char* env = std::getenv("SUPERCHIP_OPTIM_THREADS")) {
      const int v = std::atoi(env);
      TORCH_CHECK(v > 0, "SUPERCHIP_OPTIM_THREADS must be a positive integer, got '", env, "'.");
      threads = v;
    }
    g_pool = new ops::ThreadPool(std::max(1, threads), node.cpus);
  }
  return *g_pool;
}

void optimizer_pool_after_fork_child() {
  // The pool's workers do not exist in the child: leave the pool (and a lock another thread
  // may have held at fork) behind; the next step makes a new one.
  new (&g_pool_mu) std::mutex();
  g_pool = nullptr;
}

int optimizer_threads() { return optimizer_pool().num_threads(); }

const char* optimizer_simd_path() { return ops::simd_path_name(ops::active_simd_path()); }

int64_t AdamUndoLogs::bytes() const {
  int64_t b = 0;
  for (const ops::AdamUndoLog& c : chunks) b += c.bytes();
  return b;
}

int64_t AdamUndoLogs::escape_count() const {
  int64_t n = 0;
  for (const ops::AdamUndoLog& c : chunks) n += c.escapes;
  return n;
}

namespace {

// Every part's operands, bound before any is written (Note [A step is all or nothing] in
// FusedStep.h): the kernel arrays of all parts, flat, each with its part's hyper-parameters and
// its own step (Adam) or first-step flag (SGD); operands that had to be staged are kept in
// `operands` and written back by write_back(). A throw while binding destroys the staging
// copies made so far and leaves everything as it was.
template <typename Operand, typename Arrays, typename Hyper>
struct Bound {
  std::vector<Arrays> arrays;
  std::vector<Hyper> hypers;
  std::vector<Operand> operands;
  c10::DeviceIndex device = -1;  // of the first parameter: the optimizer pool's node
  void write_back() {
    for (Operand& o : operands) o.write_back();
  }
};

template <typename Operand>
Bound<Operand, ops::AdamArrays, ops::AdamHyper> bind_adam(const std::vector<AdamPart>& parts) {
  Bound<Operand, ops::AdamArrays, ops::AdamHyper> out;
  size_t total = 0;
  for (const AdamPart& part : parts) total += part.group.params.size();
  out.arrays.reserve(total);
  out.hypers.reserve(total);
  out.operands.reserve(2 * total);
  for (const AdamPart& part : parts) {
    const AdamGroup& g = part.group;
    const size_t n = g.params.size();
    TORCH_CHECK(g.grads.size() == n && g.masters.size() == n && g.exp_avgs.size() == n &&
                    g.exp_avg_sqs.size() == n && g.max_exp_avg_sqs.size() == n && g.steps.size() == n,
                "superchip.optim: internal error: ragged Adam group");
    if (n == 0) continue;
    if (out.device < 0) out.device = g.params.front().device().index();
    if (Operand::kOnHost) wait_for_executor(g.params);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& p = g.params[i];
      ops::AdamArrays a;
      bind_param_and_grad(a, i, p, g.grads[i], g.masters[i], out.operands);
      check_state<Operand>(g.exp_avgs[i], p, "exp_avg", i);
      check_state<Operand>(g.exp_avg_sqs[i], p, "exp_avg_sq", i);
      a.exp_avg = g.exp_avgs[i].data_ptr<float>();
      a.exp_avg_sq = g.exp_avg_sqs[i].data_ptr<float>();
      if (part.hyper.amsgrad) {
        TORCH_CHECK(g.max_exp_avg_sqs[i].has_value(), "superchip.optim: amsgrad state missing for parameter ", i);
        check_state<Operand>(*g.max_exp_avg_sqs[i], p, "max_exp_avg_sq", i);
        a.max_exp_avg_sq = g.max_exp_avg_sqs[i]->data_ptr<float>();
      }
      out.arrays.push_back(a);
      out.hypers.push_back(part.hyper);
      out.hypers.back().step = g.steps[i];
    }
  }
  return out;
}

template <typename Operand>
Bound<Operand, ops::SgdArrays, ops::SgdHyper> bind_sgd(const std::vector<SgdPart>& parts) {
  Bound<Operand, ops::SgdArrays, ops::SgdHyper> out;
  size_t total = 0;
  for (const SgdPart& part : parts) total += part.group.params.size();
  out.arrays.reserve(total);
  out.hypers.reserve(total);
  out.operands.reserve(2 * total);
  for (const SgdPart& part : parts) {
    const SgdGroup& g = part.group;
    const size_t n = g.params.size();
    TORCH_CHECK(g.grads.size() == n && g.masters.size() == n && g.momentum_buffers.size() == n &&
                    g.first_steps.size() == n,
                "superchip.optim: internal error: ragged SGD group");
    if (n == 0) continue;
    if (out.device < 0) out.device = g.params.front().device().index();
    if (Operand::kOnHost) wait_for_executor(g.params);
    for (size_t i = 0; i < n; ++i) {
      ops::SgdArrays a;
      bind_param_and_grad(a, i, g.params[i], g.grads[i], g.masters[i], out.operands);
      if (part.hyper.momentum != 0.0) {
        TORCH_CHECK(g.momentum_buffers[i].has_value(), "superchip.optim: momentum buffer missing for parameter ", i);
        check_state<Operand>(*g.momentum_buffers[i], g.params[i], "momentum_buffer", i);
        a.momentum_buffer = g.momentum_buffers[i]->data_ptr<float>();
      }
      out.arrays.push_back(a);
      out.hypers.push_back(part.hyper);
      out.hypers.back().first_step = g.first_steps[i];
    }
  }
  return out;
}

}  // namespace

// Note [The step's operators and Python modes]
// A step called from Python (the plain step, the tail buckets' executor step) runs ATen
// operators of its own: staging hbm operands into pinned host memory and writing them back
// (HostOperand, ExecutorOperand), casts. Called outside the dispatcher, it runs under the
// caller's TorchDispatchMode, which saw those copies as the user's (found by
// test_a_users_dispatch_mode_sees_what_the_plain_step_shows_it, with staged operands). They
// are ours: every entry point excludes the Python dispatch keys, as the engine's jobs do
// (Note [Engine jobs and Python modes] in engine/OffloadEngine.cpp).
namespace {
struct HiddenFromPythonModes {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
};

// The compute half of a step (after binding), over flat arrays: the ops/cpu kernels on the
// optimizer pool (here), or the ops/cuda kernels enqueued on `stream` (tail buckets, below).
template <typename Bound>
void compute_adam_cpu(Bound& b, void*) {
  const ops::SimdPath path = ops::active_simd_path();
  run_chunked(b.device, b.arrays, [&](const Item& it, int64_t, const ops::AdamArrays& chunk) {
    ops::adam_step(b.hypers[it.tensor], chunk, path, nullptr);
  });
}

template <typename Bound>
void compute_sgd_cpu(Bound& b, void*) {
  const ops::SimdPath path = ops::active_simd_path();
  run_chunked(b.device, b.arrays, [&](const Item& it, int64_t, const ops::SgdArrays& chunk) {
    ops::sgd_step(b.hypers[it.tensor], chunk, path, nullptr);
  });
}

}  // namespace

void fused_adam_step(const std::vector<AdamPart>& parts) {
  const HiddenFromPythonModes hidden;
  auto bound = bind_adam<HostOperand>(parts);
  compute_adam_cpu(bound, nullptr);
  bound.write_back();
}

namespace {
class BoundStaging final : public AdamStaging {
 public:
  explicit BoundStaging(Bound<HostOperand, ops::AdamArrays, ops::AdamHyper> b) : bound(std::move(b)) {}
  int64_t staged_bytes() const override {
    int64_t n = 0;
    for (const HostOperand& o : bound.operands) n += o.staged_bytes();
    return n;
  }
  Bound<HostOperand, ops::AdamArrays, ops::AdamHyper> bound;
};
}  // namespace

std::unique_ptr<AdamStaging> fused_adam_step_recorded(const std::vector<AdamPart>& parts, AdamUndoLogs* log) {
  const HiddenFromPythonModes hidden;
  for (const AdamPart& p : parts) {
    TORCH_CHECK(!p.hyper.amsgrad, "superchip.optim: internal error: amsgrad steps are not speculated");
  }
  auto staging = std::make_unique<BoundStaging>(bind_adam<HostOperand>(parts));
  auto& bound = staging->bound;
  log->chunks.assign(items_of(bound.arrays).size(), {});
  const ops::SimdPath path = ops::active_simd_path();
  run_chunked(bound.device, bound.arrays, [&](const Item& it, int64_t k, const ops::AdamArrays& chunk) {
    ops::adam_step_recording(bound.hypers[it.tensor], chunk, path, &log->chunks[k]);
  });
  bound.write_back();
  return staging;
}

void fused_adam_undo(AdamStaging& staging, const AdamUndoLogs& log) {
  const HiddenFromPythonModes hidden;
  auto& bound = static_cast<BoundStaging&>(staging).bound;
  TORCH_CHECK(log.chunks.size() == items_of(bound.arrays).size(),
              "superchip.optim: internal error: undo log does not match its bucket");
  run_chunked(bound.device, bound.arrays, [&](const Item& it, int64_t k, const ops::AdamArrays& chunk) {
    ops::adam_undo(bound.hypers[it.tensor], chunk, log.chunks[k]);
  });
  bound.write_back();
}

void fused_sgd_step(const std::vector<SgdPart>& parts) {
  const HiddenFromPythonModes hidden;
  auto bound = bind_sgd<HostOperand>(parts);
  compute_sgd_cpu(bound, nullptr);
  bound.write_back();
}

// ---- tail buckets: the step on the executor ----

namespace {

#ifdef SUPERCHIP_HAVE_OPS_CUDA
template <typename Bound>
void compute_adam_cuda(Bound& b, void* stream) {
  for (size_t i = 0; i < b.arrays.size(); ++i) ops::cuda::adam_step(b.hypers[i], b.arrays[i], stream);
}

template <typename Bound>
void compute_sgd_cuda(Bound& b, void* stream) {
  for (size_t i = 0; i < b.arrays.size(); ++i) ops::cuda::sgd_step(b.hypers[i], b.arrays[i], stream);
}

// The parameters' GPU current while the kernels launch on `stream`, a stream of that device:
// CUDA refuses a launch into another device's stream (parameters on superchip:1 stepped while
// the current device is 0).
struct ExecutorDeviceScope {
  explicit ExecutorDeviceScope(c10::DeviceIndex device) {
    if (device >= 0) guard.reset_device(executor_device(device));
  }
  c10::OptionalDeviceGuard guard;
};
#endif

template <typename Part>
c10::DeviceIndex first_device(const std::vector<Part>& parts) {
  for (const Part& p : parts) {
    if (!p.group.params.empty()) return p.group.params.front().device().index();
  }
  return -1;
}

// Bound at construction, computed by run(); keeps the parts (the arrays point into them).
template <typename Part, typename Bound>
class Prepared final : public PreparedStep {
 public:
  using Bind = Bound (*)(const std::vector<Part>&);
  using Compute = void (*)(Bound&, void*);
  Prepared(std::vector<Part> parts, void* stream, Bind bind, Compute compute)
      : parts_(std::move(parts)), stream_(stream), compute_(compute) {
    const HiddenFromPythonModes hidden;
#ifdef SUPERCHIP_HAVE_OPS_CUDA
    const ExecutorDeviceScope scope(executor() == Executor::kCuda ? first_device(parts_) : -1);
#endif
    bound_ = bind(parts_);
  }
  void run() override {
    TORCH_CHECK(!ran_, "superchip.optim: internal error: a prepared step ran twice");
    ran_ = true;
    const HiddenFromPythonModes hidden;
#ifdef SUPERCHIP_HAVE_OPS_CUDA
    const ExecutorDeviceScope scope(executor() == Executor::kCuda ? first_device(parts_) : -1);
#endif
    compute_(bound_, stream_);
    bound_.write_back();
  }

 private:
  std::vector<Part> parts_;
  void* stream_;
  Compute compute_;
  Bound bound_;
  bool ran_ = false;
};

#ifndef SUPERCHIP_HAVE_OPS_CUDA
[[noreturn]] void no_ops_cuda() {
  TORCH_CHECK(false, "superchip.optim: this build has no ops/cuda kernels (built without a CUDA toolkit); "
              "use tail_buckets=0.");
}
#endif

}  // namespace

std::unique_ptr<PreparedStep> prepare_executor_adam_step(std::vector<AdamPart> parts, void* stream) {
  if (executor() != Executor::kCuda) {
    using B = Bound<HostOperand, ops::AdamArrays, ops::AdamHyper>;
    return std::make_unique<Prepared<AdamPart, B>>(std::move(parts), stream, &bind_adam<HostOperand>,
                                                   &compute_adam_cpu<B>);
  }
#ifdef SUPERCHIP_HAVE_OPS_CUDA
  using B = Bound<ExecutorOperand, ops::AdamArrays, ops::AdamHyper>;
  return std::make_unique<Prepared<AdamPart, B>>(std::move(parts), stream, &bind_adam<ExecutorOperand>,
                                                 &compute_adam_cuda<B>);
#else
  no_ops_cuda();
#endif
}

std::unique_ptr<PreparedStep> prepare_executor_sgd_step(std::vector<SgdPart> parts, void* stream) {
  if (executor() != Executor::kCuda) {
    using B = Bound<HostOperand, ops::SgdArrays, ops::SgdHyper>;
    return std::make_unique<Prepared<SgdPart, B>>(std::move(parts), stream, &bind_sgd<HostOperand>,
                                                  &compute_sgd_cpu<B>);
  }
#ifdef SUPERCHIP_HAVE_OPS_CUDA
  using B = Bound<ExecutorOperand, ops::SgdArrays, ops::SgdHyper>;
  return std::make_unique<Prepared<SgdPart, B>>(std::move(parts), stream, &bind_sgd<ExecutorOperand>,
                                                &compute_sgd_cuda<B>);
#else
  no_ops_cuda();
#endif
}

}  // namespace superchip
