#include "backend/engine/AdamBucket.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "backend/native/Forward.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"

namespace superchip {
namespace {

std::atomic<int64_t> g_live_snapshot_bytes{0};
std::atomic<int64_t> g_live_undo_bytes{0};

void add_storage(std::vector<c10::intrusive_ptr<c10::StorageImpl>>& out, const at::Tensor& t) {
  if (!t.defined()) return;
  auto s = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl());
  for (const auto& e : out) {
    if (e.get() == s.get()) return;
  }
  out.push_back(std::move(s));
}

// A contiguous host-tier tensor shaped like `grad`, of `dtype`, holding its values.
// Note [The worker's temporaries are the executor's]: this runs on the engine's worker, on its
// own streams, while backward goes on on the compute stream. A cast made on superchip tensors
// would take an hbm block from the pool, which the compute stream may have freed a moment ago
// with its kernels still queued (one stream: blocks are reused at once, and the worker is not
// counted as a second stream); the cast would overwrite them. So the cast and the copy run on
// executor aliases: the cast's memory comes from the executor's allocator, in the worker
// stream's order (CUDA's caching allocator reuses a block only on the stream that freed it).
at::Tensor host_snapshot(const at::Tensor& grad, at::ScalarType dtype) {
  if (grad.device().type() != c10::DeviceType::PrivateUse1) {
    return grad.to(dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
  }
  // Cast on the executor first (when asked), then move: one copy into the host tier.
  const at::Tensor g = executor_alias(grad, Access::kRead);
  const at::Tensor src = g.scalar_type() == dtype ? g : g.to(dtype);
  const size_t nbytes = static_cast<size_t>(src.numel()) * src.element_size();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       allocate_in_tier(nbytes, Tier::kHost, grad.device().index()),
                       &superchip_allocator(), /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), src.dtype());
  impl->set_sizes_contiguous(src.sizes());
  at::Tensor out(std::move(impl));
  copy_through_aliases(out, src);
  return out;
}

// The same parameter: a view of the same bytes. Not TensorImpl identity: the local shard of an
// FSDP2 parameter (DTensor.to_local()) is a new view object at every step(), and comparing
// identities rolled back every speculation under FSDP2 (all of them, bit for bit needlessly).
bool same_param(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_same(b)) return true;
  if (!a.defined() || !b.defined() || !a.has_storage() || !b.has_storage()) return false;
  return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.sizes().equals(b.sizes()) &&
         a.strides().equals(b.strides()) && a.scalar_type() == b.scalar_type();
}

bool same_hyper(const ops::AdamHyper& a, const ops::AdamHyper& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && a.decoupled_weight_decay == b.decoupled_weight_decay &&
         a.amsgrad == b.amsgrad && a.maximize == b.maximize;
}

// Note [Validation compares bytes]
// A speculation holds when the gradients at step() are, bit for bit, those it stepped from.
// Validation used to skip the comparison when .grad was the same object with the same version
// counter, which every in-place change was taken to bump. Not so: a write through .data (old
// clipping and averaging recipes) shares the bytes but not the version counter, and under FSDP2
// clip_grad_norm_ scales the local shards of DTensor gradients, whose wrapper's counter stays;
// both committed steps made from the unchanged gradients. So the bytes are always compared (one
// read of the gradient and its snapshot per bucket, beside the step's traffic).

// Bitwise equality of a gradient and its snapshot (which may be its fp32 cast: exact).
bool same_bits_or_throw(const at::Tensor& grad, const at::Tensor& snap) {
  if (!grad.defined() || grad.sizes() != snap.sizes()) return false;
  // On the worker: executor temporaries only (Note [The worker's temporaries are the executor's]).
  const auto alias = [](const at::Tensor& t) {
    return t.device().type() == c10::DeviceType::PrivateUse1 ? executor_alias(t, Access::kRead) : t;
  };
  const at::Tensor s = alias(snap);
  const at::Tensor g0 = alias(grad);
  const at::Tensor g = (g0.scalar_type() == s.scalar_type() ? g0 : g0.to(s.scalar_type())).contiguous();
  const at::ScalarType bits = s.element_size() == 4 ? at::kInt : at::kShort;
  return at::equal(g.view(bits), s.contiguous().view(bits));
}

// The comparison casts and makes operands contiguous: without memory for that it answers
// "not the same", and validation undoes the step (which needs none) and redoes it plainly.
bool same_bits(const at::Tensor& grad, const at::Tensor& snap) {
  try {
    return same_bits_or_throw(grad, snap);
  } catch (const c10::OutOfMemoryError&) {
    return false;
  }
}

}  // namespace

std::vector<c10::intrusive_ptr<c10::StorageImpl>> adam_storages(const std::vector<AdamPart>& parts,
                                                                 bool with_grads) {
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> out;
  for (const AdamPart& part : parts) {
    const AdamGroup& g = part.group;
    for (size_t i = 0; i < g.params.size(); ++i) {
      add_storage(out, g.params[i]);
      if (g.masters[i]) add_storage(out, *g.masters[i]);
      add_storage(out, g.exp_avgs[i]);
      add_storage(out, g.exp_avg_sqs[i]);
      if (g.max_exp_avg_sqs[i]) add_storage(out, *g.max_exp_avg_sqs[i]);
      if (with_grads) add_storage(out, g.grads[i]);
    }
  }
  return out;
}

void step_adam_parts(const std::vector<AdamPart>& parts) { fused_adam_step(parts); }

AdamSpeculation::AdamSpeculation(int64_t owner, std::vector<AdamPart> parts, bool cast_grads_to_fp32,
                                 bool probe)
    : owner_(owner), parts_(std::move(parts)), cast_(cast_grads_to_fp32), probe_(probe) {
  for (const AdamPart& p : parts_) {
    TORCH_CHECK(!p.hyper.amsgrad, "superchip.optim: internal error: amsgrad is never speculated");
  }
}

int64_t AdamSpeculation::elements() const {
  int64_t n = 0;
  for (const AdamPart& p : parts_) {
    for (const at::Tensor& t : p.group.params) n += t.numel();
  }
  return n;
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

// Note [A speculation without memory]
// A speculation is optional work: the plain step at step() gives the same bits. Its snapshots
// take host-tier memory (2 or 4 bytes per parameter, and the executor's memory for the cast)
// that the plain run never needs, so where there is none (SUPERCHIP_HOST_BYTES, a full GPU)
// the speculation must not fail the run: it used to leave the allocator's OutOfMemoryError
// with the engine, which raised it at the next wait, in an operator that had nothing to do
// with it. Now a snapshot that finds no room abandons its speculation (or probe): what it
// had copied is freed, nothing is stepped, validate() runs the plain step, and the engine's
// predictor backs off as after a failure (python/superchip/engine.py, `abandoned_buckets`).
// The engine also admits a speculation only while the host tier has room for its snapshot
// and for what the training thread allocated there in the last backward, so this is the
// exception. Snapshots are ours alone (host_snapshot's fresh tensors, never given to Python),
// so the worker may free them (Note [Engine and the GIL]); a gradient they replaced stays in
// the job's `keep`.
void AdamSpeculation::snapshot() {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> snaps;
  try {
    for (const AdamPart& p : parts_) {
      for (const at::Tensor& g : p.group.grads) snaps.push_back(host_snapshot(g, cast_ ? at::kFloat : g.scalar_type()));
    }
  } catch (const c10::OutOfMemoryError&) {
    snaps.clear();
    int expected = kQueued;
    status_.compare_exchange_strong(expected, kAbandoned);
    seconds_ = seconds_.load() + seconds_since(t0);
    return;
  }
  size_t i = 0;
  int64_t bytes = 0;
  for (AdamPart& p : parts_) {
    for (at::Tensor& g : p.group.grads) {
      if (snaps[i].device().type() == c10::DeviceType::PrivateUse1) bytes += static_cast<int64_t>(snaps[i].nbytes());
      g = std::move(snaps[i++]);
    }
  }
  snapped_ = true;
  snapshot_bytes_ = bytes;
  g_live_snapshot_bytes.fetch_add(bytes, std::memory_order_relaxed);
  seconds_ = seconds_.load() + seconds_since(t0);  // only the worker writes it
}

void AdamSpeculation::release_snapshots() {
  if (!snapped_) return;
  for (AdamPart& p : parts_) {
    for (at::Tensor& g : p.group.grads) g = at::Tensor();
  }
  snapped_ = false;
  g_live_snapshot_bytes.fetch_sub(snapshot_bytes_, std::memory_order_relaxed);
  snapshot_bytes_ = 0;
}

void AdamSpeculation::drop_logs() {
  staging_.reset();  // before the snapshots go: it holds them too
  logs_ = AdamUndoLogs();
  g_live_undo_bytes.fetch_sub(live_undo_bytes_, std::memory_order_relaxed);
  live_undo_bytes_ = 0;
}

AdamSpeculation::~AdamSpeculation() {
  // A speculation dropped before validation (its step() never came): its snapshots and undo
  // log go now.
  g_live_snapshot_bytes.fetch_sub(snapshot_bytes_, std::memory_order_relaxed);
  g_live_undo_bytes.fetch_sub(live_undo_bytes_, std::memory_order_relaxed);
}

int64_t AdamSpeculation::live_snapshot_bytes() { return g_live_snapshot_bytes.load(std::memory_order_relaxed); }

int64_t AdamSpeculation::live_undo_bytes() { return g_live_undo_bytes.load(std::memory_order_relaxed); }

void AdamSpeculation::step() {
  TORCH_CHECK(!probe_, "superchip.optim: internal error: a probe is never stepped speculatively");
  if (status_.load() == kAbandoned) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // All parts or none (Note [A step is all or nothing] in optim/FusedStep.h): a staging copy
    // that finds no room raises before anything is written, and the speculation is abandoned
    // like one whose snapshot found none. Stepped part by part, a later part's error left the
    // earlier ones stepped outside the undo log (validation then stepped them a second time),
    // and the error reached the training thread at its next wait.
    staging_ = fused_adam_step_recorded(parts_, &logs_);
  } catch (const c10::OutOfMemoryError&) {
    drop_logs();
    release_snapshots();
    int expected = kQueued;
    status_.compare_exchange_strong(expected, kAbandoned);
    seconds_ = seconds_.load() + seconds_since(t0);
    return;
  }
  undo_bytes_ = logs_.bytes();
  escapes_ = logs_.escape_count();
  live_undo_bytes_ = logs_.bytes() + staging_->staged_bytes();
  g_live_undo_bytes.fetch_add(live_undo_bytes_, std::memory_order_relaxed);
  seconds_ = seconds_.load() + seconds_since(t0);
  int expected = kQueued;
  status_.compare_exchange_strong(expected, kSpeculated);
}

void AdamSpeculation::rollback() {
  if (status_.load() != kSpeculated) {
    if (probe_) release_snapshots();  // a probe whose step() never came
    return;
  }
  fused_adam_undo(*staging_, logs_);  // allocates nothing (Note [An undo needs no memory])
  drop_logs();
  release_snapshots();
  status_ = kRolledBack;
}

void AdamSpeculation::validate(std::vector<AdamPart> current) {
  TORCH_CHECK(current.size() == parts_.size(), "superchip.optim: internal error: bucket changed shape");
  if (status_.load() == kAbandoned) {  // Note [A speculation without memory]
    step_adam_parts(current);
    return;
  }
  if (probe_) {
    // Would a speculation have held? Only the gradients decide (a new learning rate from a
    // scheduler changes every step and says nothing about the next one).
    bool valid = true;
    for (size_t k = 0; valid && k < parts_.size(); ++k) {
      const AdamGroup& was = parts_[k].group;
      const AdamGroup& now = current[k].group;
      valid = was.params.size() == now.params.size();
      for (size_t i = 0; valid && i < now.params.size(); ++i) {
        valid = same_bits(now.grads[i], was.grads[i]);
      }
    }
    release_snapshots();
    step_adam_parts(current);
    status_ = valid ? kProbeValid : kProbeInvalid;
    return;
  }
  bool valid = status_.load() == kSpeculated;
  try {
    for (size_t k = 0; valid && k < parts_.size(); ++k) {
      const AdamGroup& was = parts_[k].group;
      const AdamGroup& now = current[k].group;
      valid = same_hyper(parts_[k].hyper, current[k].hyper) && was.params.size() == now.params.size() &&
              was.steps == now.steps;
      for (size_t i = 0; valid && i < now.params.size(); ++i) {
        // Always the bytes: a gradient's object and version counter say nothing about writes
        // through .data or to a DTensor gradient's local shard (Note [Validation compares bytes]).
        valid = same_param(now.params[i], was.params[i]) && same_bits(now.grads[i], was.grads[i]);
      }
    }
  } catch (...) {
    // Note [A validation that fails]: the comparison could not be made (not for lack of
    // memory: that answers "not the same"). Nothing says the speculation used the gradients
    // step() was given, so it does not stand: it is undone (which needs no memory) and the
    // job fails, so the bucket is left unstepped, as a failed plain job leaves it, and its
    // optimizer raises the error at its next step().
    rollback();
    release_snapshots();
    throw;
  }
  if (valid) {
    drop_logs();
    release_snapshots();
    status_ = kCommitted;
    return;
  }
  rollback();  // frees the snapshots too
  release_snapshots();  // (also when nothing was stepped)
  step_adam_parts(current);
  status_ = kRedone;
}

}  // namespace superchip
