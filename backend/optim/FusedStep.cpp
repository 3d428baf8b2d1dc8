#include "backend/optim/FusedStep.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
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

// HostOperand for the windowed step (Note [The step's staging window] in FusedStep.h): a
// contiguous operand the kernel cannot address (hbm under the CUDA executor) is not staged
// whole here but slice by slice through the window, by run_windowed(); every other operand is
// bound as HostOperand binds it (in place, or a strided one staged whole).
class WindowOperand {
 public:
  static constexpr bool kOnHost = true;
  static bool addressable(const at::Tensor& t) { return host_addressable(t); }

  WindowOperand(const at::Tensor& t, bool written) : original_(t), written_(written) {
    if (t.is_contiguous() && (!host_addressable(t) || staged_for_emulation(t))) {
      wait_pending(t);
    } else {
      bound_.emplace(t, written);
    }
  }
  bool windowed() const { return !bound_.has_value(); }
  // Null for a windowed operand: run_windowed() points the kernel at the window.
  void* data() const { return bound_ ? bound_->data() : nullptr; }
  const at::Tensor& original() const { return original_; }
  bool written() const { return written_; }
  void write_back() {
    if (bound_) {
      bound_->write_back();
    } else if (written_) {  // its bytes went back window by window
      WeightStreamer::get().note_written(original_.storage().unsafeGetStorageImpl());
    }
  }

 private:
  at::Tensor original_;
  bool written_;
  std::optional<HostOperand> bound_;
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
    // The GPU only: superchip's own synchronizeDevice also waits for the offload engine (and
    // raises another optimizer's failed step), which a plain step must not.
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
        ->synchronizeDevice(executor_device(p.device().index()).index());
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
    if (const int v = optimizer_threads_from_env(); v > 0) threads = v;
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

int optimizer_threads_from_env() {
  const char* env = std::getenv("SUPERCHIP_OPTIM_THREADS");
  if (env == nullptr || *env == '\0') return 0;
  // A whole number up to 4x the machine's hardware threads. It was read with atoi: "4abc" ran
  // 4 threads, and 100000 started 100000 (the process stalled with 32k threads, and the
  // machine with it: found by review).
  const unsigned hw = std::max(1U, std::thread::hardware_concurrency());
  const long most = 4L * hw;
  const long v = parse_whole_number(env);
  TORCH_CHECK(v > 0 && v <= most, "SUPERCHIP_OPTIM_THREADS must be a whole number of threads from 1 to ",
              most, " (4x this machine's ", hw, " hardware threads); got '", env, "'. Unset it for "
              "the cores of the GPU-local NUMA node.");
  return static_cast<int>(v);
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

// ---- Note [The step's staging window] (FusedStep.h): the plain step ----

constexpr int64_t kWindowAlign = 64;  // bytes: each slice in the window starts on a cache line
constexpr int64_t kMinWindowBytes = 4096;
constexpr int64_t kDefaultWindowBytes = int64_t{64} << 20;

int64_t align_up(int64_t v) { return (v + kWindowAlign - 1) / kWindowAlign * kWindowAlign; }

int64_t step_window_bytes() {
  const char* env = std::getenv("SUPERCHIP_STEP_WINDOW_BYTES");
  if (env == nullptr || *env == '\0') return kDefaultWindowBytes;
  // The forms of the tier budgets (bytes, 64M, 1G), read the same way.
  const size_t v = parse_bytes(env, "SUPERCHIP_STEP_WINDOW_BYTES", /*zero_is_unlimited=*/false);
  TORCH_CHECK(v >= static_cast<size_t>(kMinWindowBytes), "SUPERCHIP_STEP_WINDOW_BYTES must be at least ",
              kMinWindowBytes, " bytes; got '", env, "'. Unset it for the default (64M).");
  return static_cast<int64_t>(v);  // parse_bytes refuses 2^63 and more
}

// `n` elements of `dtype` at element offset `offset` of `storage`: a superchip tensor made
// without the dispatcher or autograd (a view of a parameter that requires grad would be an
// autograd view, and the write-back is the backend's own write, not the user's).
at::Tensor flat_view(const c10::Storage& storage, int64_t offset, int64_t n, at::ScalarType dtype) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage),
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous({n});
  impl->set_storage_offset(offset);
  return at::Tensor(std::move(impl));
}

at::Tensor flat_range(const at::Tensor& t, int64_t begin, int64_t n) {
  return flat_view(t.storage(), t.storage_offset() + begin, n, t.scalar_type());
}

// The window of `device`: a host-tier block (pinned and mapped under the CUDA executor; counted
// in host's statistics, where torch's pinned cache would have kept the largest step's copies
// for good, outside every budget). Without room for `want` bytes it takes half, down to
// kMinWindowBytes, and only then raises, before anything was written.
c10::Storage window_storage(int64_t want, c10::DeviceIndex device) {
  int64_t size = want;
  for (;;) {
    try {
      return c10::Storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(size),
                          allocate_in_tier(static_cast<size_t>(size), Tier::kHost, device),
                          &superchip_allocator(), /*resizable=*/false);
    } catch (const c10::OutOfMemoryError& e) {
      if (size <= kMinWindowBytes) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "superchip.optim: the step copies the hbm parameters and gradients ",
                         "the CPU cannot address through a staging window in host, and host has no room even for ",
                         size, " bytes: ", e.what_without_backtrace(),
                         "\nNothing was stepped. Free host memory (or raise its budget) and call step() again.");
      }
      size = std::max(kMinWindowBytes, size / 2);
    }
  }
}

// The CPU reads the window once the copies into it, queued on the current stream, have run.
void wait_for_window_copies(c10::DeviceIndex device) {
  if (executor() != Executor::kCuda) return;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
  impl->synchronizeStream(impl->getStream(c10::Device(c10::DeviceType::PrivateUse1, device)));
}

// One array's share of a window: elements [begin, begin + n) of array `array`; where its
// gradient / parameter go through the window, their byte offsets in it (else -1).
struct Piece {
  size_t array;
  int64_t begin;
  int64_t n;
  int64_t grad_at = -1;
  int64_t param_at = -1;
};

// Runs `kernel(hyper, arrays)` over every element of `b`: the arrays addressed in place in one
// pass, then those with a windowed operand slice by slice through a window per device.
// Elementwise kernels give the same bits however the elements are cut (ops/cpu/FusedOptim.h).
template <typename Arrays, typename Hyper, typename Kernel>
void run_windowed(Bound<WindowOperand, Arrays, Hyper>& b, const Kernel& kernel) {
  const size_t n = b.arrays.size();
  std::vector<int64_t> per(n, 0);  // window bytes per element
  std::vector<size_t> in_place;
  std::vector<std::pair<c10::DeviceIndex, std::vector<size_t>>> by_device;
  std::vector<int64_t> need;
  for (size_t i = 0; i < n; ++i) {
    if (b.arrays[i].n == 0) continue;  // nothing to step (a piece of it would never fill a window)
    const WindowOperand& g = b.operands[2 * i];
    const WindowOperand& p = b.operands[2 * i + 1];
    if (g.windowed()) per[i] += g.original().element_size();
    if (p.windowed()) per[i] += p.original().element_size();
    if (per[i] == 0) {
      in_place.push_back(i);
      continue;
    }
    const c10::DeviceIndex d = p.original().device().index();
    size_t k = 0;
    while (k < by_device.size() && by_device[k].first != d) ++k;
    if (k == by_device.size()) {
      by_device.emplace_back(d, std::vector<size_t>{});
      need.push_back(0);
    }
    by_device[k].second.push_back(i);
    need[k] += per[i] * b.arrays[i].n + 2 * kWindowAlign;
  }
  const auto run = [&](c10::DeviceIndex device, const std::vector<Arrays>& arrays, const std::vector<Hyper>& hypers) {
    run_chunked(device, arrays, [&](const Item& it, int64_t, const Arrays& chunk) { kernel(hypers[it.tensor], chunk); });
  };
  // Every window is taken before anything is written (Note [A step is all or nothing]).
  std::vector<c10::Storage> windows;
  if (!by_device.empty()) {
    const int64_t cap = step_window_bytes();
    for (size_t k = 0; k < by_device.size(); ++k) {
      windows.push_back(window_storage(std::min(cap, need[k]), by_device[k].first));
    }
  }
  if (!in_place.empty()) {
    std::vector<Arrays> arrays;
    std::vector<Hyper> hypers;
    for (size_t i : in_place) {
      arrays.push_back(b.arrays[i]);
      hypers.push_back(b.hypers[i]);
    }
    run(b.device, arrays, hypers);
  }
  for (size_t k = 0; k < by_device.size(); ++k) {
    const c10::DeviceIndex device = by_device[k].first;
    const std::vector<size_t>& list = by_device[k].second;
    const c10::Storage& window = windows[k];
    const int64_t cap = static_cast<int64_t>(window.nbytes());
    char* base = static_cast<char*>(window.mutable_data());
    size_t next = 0;
    int64_t pos = 0;
    while (next < list.size()) {
      std::vector<Piece> pieces;
      int64_t used = 0;
      while (next < list.size()) {
        const size_t i = list[next];
        const int64_t left = b.arrays[i].n - pos;
        int64_t take = std::min(left, std::max<int64_t>(0, cap - used - 2 * kWindowAlign) / per[i]);
        if (take < left) take = take / kWindowAlign * kWindowAlign;  // whole cache lines inside a tensor
        if (take <= 0) break;
        Piece piece{i, pos, take};
        if (b.operands[2 * i].windowed()) {
          piece.grad_at = used = align_up(used);
          used += take * b.operands[2 * i].original().element_size();
        }
        if (b.operands[2 * i + 1].windowed()) {
          piece.param_at = used = align_up(used);
          used += take * b.operands[2 * i + 1].original().element_size();
        }
        pieces.push_back(piece);
        pos += take;
        if (pos == b.arrays[i].n) {
          ++next;
          pos = 0;
        }
      }
      TORCH_INTERNAL_ASSERT(!pieces.empty(), "superchip.optim: staging window too small");
      const auto in_window = [&](const WindowOperand& o, int64_t at, const Piece& piece) {
        return flat_view(window, at / o.original().element_size(), piece.n, o.original().scalar_type());
      };
      std::vector<Arrays> arrays;
      std::vector<Hyper> hypers;
      for (const Piece& piece : pieces) {
        const WindowOperand& g = b.operands[2 * piece.array];
        const WindowOperand& p = b.operands[2 * piece.array + 1];
        Arrays a = slice(b.arrays[piece.array], piece.begin, piece.begin + piece.n);
        if (piece.grad_at >= 0) {
          copy_through_aliases(in_window(g, piece.grad_at, piece), flat_range(g.original(), piece.begin, piece.n),
                               Access::kCopySource);
          a.grad = base + piece.grad_at;
        }
        if (piece.param_at >= 0) {
          const bool lowp = p.original().scalar_type() != at::kFloat;
          // A low-precision parameter is only written (from its fp32 master): nothing to copy in.
          if (!lowp) {
            copy_through_aliases(in_window(p, piece.param_at, piece), flat_range(p.original(), piece.begin, piece.n),
                                 Access::kCopySource);  // (a weight read whole: not a read the streamer plans)
            a.param = reinterpret_cast<float*>(base + piece.param_at);
          } else {
            a.param_lowp = base + piece.param_at;
          }
        }
        arrays.push_back(a);
        hypers.push_back(b.hypers[piece.array]);
      }
      wait_for_window_copies(device);
      run(device, arrays, hypers);
      for (const Piece& piece : pieces) {
        if (piece.param_at < 0) continue;
        const WindowOperand& p = b.operands[2 * piece.array + 1];
        copy_through_aliases(flat_range(p.original(), piece.begin, piece.n), in_window(p, piece.param_at, piece));
      }
      // The next window's copies in are queued behind these write-backs: same stream.
    }
  }
}

}  // namespace

void fused_adam_step(const std::vector<AdamPart>& parts) {
  const HiddenFromPythonModes hidden;
  const WeightStreamer::OperatorScope in_operator;  // Note [One thread runs the operators]
  auto bound = bind_adam<WindowOperand>(parts);
  const ops::SimdPath path = ops::active_simd_path();
  run_windowed(bound, [&](const ops::AdamHyper& h, const ops::AdamArrays& a) { ops::adam_step(h, a, path, nullptr); });
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
  const WeightStreamer::OperatorScope in_operator;  // Note [One thread runs the operators]
  auto bound = bind_sgd<WindowOperand>(parts);
  const ops::SimdPath path = ops::active_simd_path();
  run_windowed(bound, [&](const ops::SgdHyper& h, const ops::SgdArrays& a) { ops::sgd_step(h, a, path, nullptr); });
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
    const WeightStreamer::OperatorScope in_operator;  // Note [One thread runs the operators]
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
