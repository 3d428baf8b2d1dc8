// superchip._C bindings of the fused optimizer steps (backend/optim/) and of the offload engine
// (backend/engine/): thin argument conversion.
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include "backend/engine/AdamBucket.h"
#include "backend/engine/OffloadEngine.h"
#include "backend/optim/FusedStep.h"
#include "backend/stream/WeightStreamer.h"

namespace py = pybind11;

namespace superchip {
namespace {

// One param group's share of a step or bucket, as optim.py builds it (_group_args).
using AdamPartArgs =
    std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
               std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
               std::vector<int64_t>, double, double, double, double, double, bool, bool, bool>;
using SgdArgs =
    std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
               std::vector<std::optional<at::Tensor>>, std::vector<bool>, double, double, double,
               double, bool, bool>;

// Note [A step binds the storages of its call]
// A step's parameters and gradients are taken as the storages they view when step() (or a
// speculation) is called, not as the tensor objects: `p.data = new` swaps the storage inside
// the parameter's own TensorImpl. Held as the objects, a speculation made from the old storage
// validated against itself (same object, so "the same parameter") and was committed: the old
// storage stepped, the assigned data never (found by review); and a queued job bound whatever
// storage the object held when it ran, stepping data assigned after step() returned. Each
// tensor is replaced by an alias of the same storage, sizes and strides (a shallow detached
// copy of its TensorImpl, made without the dispatcher: no Python mode sees it), so validation
// sees a swap as a different parameter (rolled back, the new data stepped plainly), and a
// queued job steps, and keeps alive, the bytes step() was given.
void bind_storages(std::vector<at::Tensor>& ts) {
  // Under a user's TorchDispatchMode, TensorImpl's detach asks the mode (aten.detach): these
  // aliases are ours (Note [The step's operators and Python modes] in optim/FusedStep.cpp).
  const c10::impl::ExcludeDispatchKeyGuard hidden(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  for (at::Tensor& t : ts) {
    if (!t.defined()) continue;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    t = at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/false));
  }
}

std::vector<AdamPart> adam_parts(std::vector<AdamPartArgs> args) {
  std::vector<AdamPart> parts;
  parts.reserve(args.size());
  for (auto& a : args) {
    AdamPart p;
    p.group = AdamGroup{std::move(std::get<0>(a)), std::move(std::get<1>(a)), std::move(std::get<2>(a)),
                        std::move(std::get<3>(a)), std::move(std::get<4>(a)), std::move(std::get<5>(a)),
                        std::move(std::get<6>(a))};
    p.hyper.lr = std::get<7>(a);
    p.hyper.beta1 = std::get<8>(a);
    p.hyper.beta2 = std::get<9>(a);
    p.hyper.eps = std::get<10>(a);
    p.hyper.weight_decay = std::get<11>(a);
    p.hyper.decoupled_weight_decay = std::get<12>(a);
    p.hyper.amsgrad = std::get<13>(a);
    p.hyper.maximize = std::get<14>(a);
    bind_storages(p.group.params);
    bind_storages(p.group.grads);
    parts.push_back(std::move(p));
  }
  return parts;
}

std::vector<SgdPart> sgd_parts(std::vector<SgdArgs> args) {
  std::vector<SgdPart> parts;
  parts.reserve(args.size());
  for (auto& a : args) {
    SgdPart p;
    p.group = SgdGroup{std::move(std::get<0>(a)), std::move(std::get<1>(a)), std::move(std::get<2>(a)),
                       std::move(std::get<3>(a)), std::move(std::get<4>(a))};
    p.hyper.lr = std::get<5>(a);
    p.hyper.momentum = std::get<6>(a);
    p.hyper.dampening = std::get<7>(a);
    p.hyper.weight_decay = std::get<8>(a);
    p.hyper.nesterov = std::get<9>(a);
    p.hyper.maximize = std::get<10>(a);
    bind_storages(p.group.params);
    bind_storages(p.group.grads);
    parts.push_back(std::move(p));
  }
  return parts;
}

std::vector<at::Tensor> tensors_of(const std::vector<AdamPart>& parts) {
  std::vector<at::Tensor> keep;
  for (const AdamPart& p : parts) {
    keep.insert(keep.end(), p.group.params.begin(), p.group.params.end());
    keep.insert(keep.end(), p.group.grads.begin(), p.group.grads.end());
  }
  return keep;
}

// Note [A job of the asynchronous step that fails]
// A queued step (or a validation's redo) can raise on the worker: no memory to stage an
// operand (an hbm one into pinned memory on a GPU, a strided one on the CPU executor). The
// step is all or nothing (Note [A step is all or nothing] in optim/FusedStep.h), so that
// bucket is as before; the other buckets of the step() were stepped. The optimizer takes the
// failed tickets (take_failures) and restores the bucket's bookkeeping (step counts, SGD's
// first-step marks: python/superchip/engine.py, Engine._reconcile), so the next step of those
// parameters is their next step. The operators that wait for a pending step do not raise, so
// the error is kept for its optimizer (OffloadEngine::take_error): its next step() raises it
// before changing anything (or its synchronize, or the first torch.superchip.synchronize()),
// saying what happened and what to do. Kept in one slot for all, a second optimizer's error
// was dropped, and another optimizer's state_dict() raised the first's (found by review).
template <typename F>
void run_step_job(const char* what, size_t params, const F& body) {
  try {
    body();
  } catch (const c10::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "superchip.optim: the asynchronous ", what, " of a bucket of ",
                     params, " parameters could not run: ", e.what_without_backtrace(),
                     "\nThat bucket was not stepped: its parameters, optimizer state and step counts are as "
                     "before that step() (the other buckets of that step() were stepped). Free memory "
                     "before the next step(), or pass overlap=False to have step() itself raise this, "
                     "with nothing stepped.");
  }
}

template <typename Part>
size_t params_of(const std::vector<Part>& parts) {
  size_t n = 0;
  for (const Part& p : parts) n += p.group.params.size();
  return n;
}

}  // namespace

void bind_engine(py::module& m) {
  using Spec = AdamSpeculation;
  py::class_<Spec, std::shared_ptr<Spec>>(m, "_AdamSpeculation")
      .def(py::init([](int64_t owner, std::vector<AdamPartArgs> parts, bool cast_fp32, bool probe) {
             return std::make_shared<Spec>(owner, adam_parts(std::move(parts)), cast_fp32, probe);
           }),
           py::arg("owner"), py::arg("parts"), py::arg("cast_fp32"), py::arg("probe") = false)
      .def("status", &Spec::status)
      .def("undo_bytes", &Spec::undo_bytes)
      .def("escapes", &Spec::escapes)
      .def("elements", &Spec::elements)
      .def("seconds", &Spec::seconds);

  m.def("_engine_adam_step", [](int64_t owner, std::vector<AdamPartArgs> args) {
    auto parts = std::make_shared<std::vector<AdamPart>>(adam_parts(std::move(args)));
    EngineJob job;
    job.name = "superchip::cpu_step";
    job.owner = owner;
    job.touched = adam_storages(*parts, /*with_grads=*/true);
    job.keep = tensors_of(*parts);
    job.run = [parts] { run_step_job("step", params_of(*parts), [&] { step_adam_parts(*parts); }); };
    return OffloadEngine::get().submit(std::move(job));
  });
  m.def("_engine_sgd_step", [](int64_t owner, std::vector<SgdArgs> args) {
    auto parts = std::make_shared<std::vector<SgdPart>>(sgd_parts(std::move(args)));
    EngineJob job;
    job.name = "superchip::cpu_step";
    job.owner = owner;
    auto add = [&](const at::Tensor& t) {
      if (t.defined()) {
        job.touched.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
      }
    };
    for (const SgdPart& p : *parts) {
      const SgdGroup& g = p.group;
      for (size_t i = 0; i < g.params.size(); ++i) {
        add(g.params[i]);
        add(g.grads[i]);
        if (g.masters[i]) add(*g.masters[i]);
        if (g.momentum_buffers[i]) add(*g.momentum_buffers[i]);
      }
      job.keep.insert(job.keep.end(), g.params.begin(), g.params.end());
      job.keep.insert(job.keep.end(), g.grads.begin(), g.grads.end());
    }
    job.run = [parts] { run_step_job("step", params_of(*parts), [&] { fused_sgd_step(*parts); }); };
    return OffloadEngine::get().submit(std::move(job));
  });
  // The plain step (overlap=False) and the tail buckets' step, on the calling thread: every
  // part (param group) in one call, all or nothing (Note [A step is all or nothing] in
  // optim/FusedStep.h). A stream (a tail bucket): the executor steps it; none: the CPU kernels.
  m.def("_adam_step", [](std::vector<AdamPartArgs> args, std::optional<uintptr_t> stream) {
    std::vector<AdamPart> parts = adam_parts(std::move(args));
    py::gil_scoped_release no_gil;
    if (stream) prepare_executor_adam_step(std::move(parts), reinterpret_cast<void*>(*stream))->run();
    else fused_adam_step(parts);
  }, py::arg("parts"), py::arg("stream") = py::none());
  m.def("_sgd_step", [](std::vector<SgdArgs> args, std::optional<uintptr_t> stream) {
    std::vector<SgdPart> parts = sgd_parts(std::move(args));
    py::gil_scoped_release no_gil;
    if (stream) prepare_executor_sgd_step(std::move(parts), reinterpret_cast<void*>(*stream))->run();
    else fused_sgd_step(parts);
  }, py::arg("parts"), py::arg("stream") = py::none());
  // The tail buckets' step bound now and run later (optim/FusedStep.h): Engine.step() binds it
  // before it queues any job, so an error there leaves the whole step()'s work undone.
  py::class_<PreparedStep>(m, "_PreparedStep").def("run", [](PreparedStep& s) {
    py::gil_scoped_release no_gil;
    s.run();
  });
  m.def("_prepare_adam_step", [](std::vector<AdamPartArgs> args, uintptr_t stream) {
    std::vector<AdamPart> parts = adam_parts(std::move(args));
    py::gil_scoped_release no_gil;
    return prepare_executor_adam_step(std::move(parts), reinterpret_cast<void*>(stream));
  }, py::arg("parts"), py::arg("stream"));
  m.def("_prepare_sgd_step", [](std::vector<SgdArgs> args, uintptr_t stream) {
    std::vector<SgdPart> parts = sgd_parts(std::move(args));
    py::gil_scoped_release no_gil;
    return prepare_executor_sgd_step(std::move(parts), reinterpret_cast<void*>(stream));
  }, py::arg("parts"), py::arg("stream"));
  // Snapshot jobs (and, unless the spec is a probe, the speculative step and its hold).
  // `grads_pending` false: readers of the gradients' storages do not wait for the copy (DDP's
  // bucket buffer, which its end of backward reads while the copy waits behind the speculative
  // steps queued before it: Note [Speculation under DDP] in python/superchip/distributed.py;
  // nothing writes it before the next backward, and validation compares the copy bit for bit).
  m.def("_engine_speculate", [](std::shared_ptr<Spec> spec, bool probe, bool grads_pending) {
    OffloadEngine& e = OffloadEngine::get();
    EngineJob copy;
    copy.name = "superchip::bucket_copy";
    copy.owner = spec->owner();
    for (const AdamPart& p : spec->parts()) {
      for (const at::Tensor& g : p.group.grads) {
        if (grads_pending) {
          copy.touched.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(g.storage().unsafeGetStorageImpl()));
        }
        copy.keep.push_back(g);  // snapshot() replaces it on the worker: the job drops it later
      }
    }
    copy.run = [spec] { spec->snapshot(); };
    const uint64_t copied = e.submit(std::move(copy));
    if (probe) return copied;  // the state is not touched: nothing to hold
    EngineJob step;
    step.name = "superchip::speculative_step";
    step.owner = spec->owner();
    step.touched = adam_storages(spec->parts(), /*with_grads=*/false);
    step.run = [spec] { spec->step(); };
    const uint64_t ticket = e.submit(std::move(step));
    e.hold(adam_storages(spec->parts(), /*with_grads=*/false), spec);
    return ticket;
  }, py::arg("spec"), py::arg("probe"), py::arg("grads_pending") = true);
  m.def("_engine_validate", [](std::shared_ptr<Spec> spec, std::vector<AdamPartArgs> args) {
    auto parts = std::make_shared<std::vector<AdamPart>>(adam_parts(std::move(args)));
    EngineJob job;
    job.name = "superchip::validate";
    job.owner = spec->owner();
    job.touched = adam_storages(*parts, /*with_grads=*/true);
    job.keep = tensors_of(*parts);
    job.run = [spec, parts] {
      const size_t n = params_of(*parts);
      run_step_job("step (validating its speculation)", n, [&] { spec->validate(std::move(*parts)); });
    };
    return OffloadEngine::get().submit_replacing_hold(std::move(job), spec.get());
  });
  m.def("_engine_rollback", [](std::shared_ptr<Spec> spec) {
    EngineJob job;
    job.name = "superchip::rollback";
    job.owner = spec->owner();
    job.touched = adam_storages(spec->parts(), /*with_grads=*/false);
    job.run = [spec] { spec->rollback(); };
    return OffloadEngine::get().submit_replacing_hold(std::move(job), spec.get());
  });
  m.def("_engine_wait", [](uint64_t ticket, int64_t owner) {
    py::gil_scoped_release no_gil;
    OffloadEngine::get().wait(ticket, owner);
  });
  m.def("_engine_synchronize", [](bool charge_exposed, bool raise_errors) {
    py::gil_scoped_release no_gil;
    OffloadEngine::get().synchronize(charge_exposed, raise_errors);
  }, py::arg("charge_exposed") = true, py::arg("raise_errors") = true);
  // Compiled graphs read data_ptr() directly, past the dispatcher's check (Forward.cpp): the
  // Inductor wrapper calls this with its inputs first (python/superchip/_inductor/codegen.py).
  // The waits run without the GIL, as _engine_wait does: a job may need it (a CUDA allocation
  // under torch.cuda.memory._record_memory_history takes it to record the Python stack).
  m.def("_engine_wait_inputs", [](py::args args) {
    // Raw pointers: `args` keeps their tensors, so the storages, alive through the call.
    std::vector<c10::StorageImpl*> storages;
    for (const py::handle a : args) {
      if (!THPVariable_Check(a.ptr())) continue;
      const at::Tensor& t = THPVariable_Unpack(a.ptr());
      if (t.defined() && t.device().type() == c10::DeviceType::PrivateUse1 && t.has_storage()) {
        storages.push_back(t.storage().unsafeGetStorageImpl());
      }
    }
    py::gil_scoped_release no_gil;
    OffloadEngine& e = OffloadEngine::get();
    WeightStreamer& streamer = WeightStreamer::get();
    const bool streaming = streamer.active();
    for (c10::StorageImpl* s : storages) {
      e.wait_for_storage(s);
      // Generated kernels read and write inputs in place, past the forwarding layer: a staged
      // copy of an input may be stale after the graph (Note [Staged copies and writes]).
      if (streaming) streamer.note_written(s);
    }
  });
  // A storage read raw, past superchip's operators (torch's legacy serializer: pickle and
  // torch.save(_use_new_zipfile_serialization=False); Note [Storages written to files] in
  // python/superchip/__init__.py): its pending steps first, a speculation rolled back.
  m.def("_engine_wait_storage", [](py::handle storage) {
    TORCH_CHECK(THPStorage_Check(storage.ptr()), "superchip: internal error: not a storage");
    c10::StorageImpl* s = THPStorage_Unpack(storage.ptr()).unsafeGetStorageImpl();
    py::gil_scoped_release no_gil;
    OffloadEngine::get().wait_for_storage(s);
  });
  m.def("_engine_snapshot_bytes", &AdamSpeculation::live_snapshot_bytes);
  m.def("_engine_undo_bytes", &AdamSpeculation::live_undo_bytes);
  // (tickets of `owner`'s jobs that raised since the last call, the last ticket that has run)
  m.def("_engine_failures", [](int64_t owner) {
    OffloadEngine::Failures f = OffloadEngine::get().take_failures(owner);
    return py::make_tuple(f.tickets, f.done_upto);
  });
  // Raises `owner`'s kept job exception, if one was not raised yet (its own type and message).
  m.def("_engine_raise_error", [](int64_t owner) {
    if (std::exception_ptr err = OffloadEngine::get().take_error(owner)) std::rethrow_exception(err);
  });
  m.def("_engine_stats", [](int64_t owner) {
    const OwnerStats s = OffloadEngine::get().stats(owner);
    py::dict d;
    d["optimizer_seconds"] = s.optimizer_seconds;
    d["exposed_seconds"] = s.exposed_seconds;
    d["rollbacks_on_read"] = s.rollbacks_on_read;
    return d;
  });
}

}  // namespace superchip
