// superchip._C bindings of the offload engine (backend/engine/): thin argument conversion.
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

// One param group's share of a bucket, as optim.py builds it (the _adam_step arguments).
using AdamPartArgs =
    std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
               std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
               std::vector<int64_t>, double, double, double, double, double, bool, bool, bool>;
using SgdArgs =
    std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
               std::vector<std::optional<at::Tensor>>, std::vector<bool>, double, double, double,
               double, bool, bool>;

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
    job.run = [parts] { step_adam_parts(*parts); };
    return OffloadEngine::get().submit(std::move(job));
  });
  m.def("_engine_sgd_step", [](int64_t owner, SgdArgs a) {
    auto g = std::make_shared<SgdGroup>(SgdGroup{std::move(std::get<0>(a)), std::move(std::get<1>(a)),
                                                 std::move(std::get<2>(a)), std::move(std::get<3>(a)),
                                                 std::move(std::get<4>(a))});
    ops::SgdHyper h;
    h.lr = std::get<5>(a);
    h.momentum = std::get<6>(a);
    h.dampening = std::get<7>(a);
    h.weight_decay = std::get<8>(a);
    h.nesterov = std::get<9>(a);
    h.maximize = std::get<10>(a);
    EngineJob job;
    job.name = "superchip::cpu_step";
    job.owner = owner;
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> touched;
    auto add = [&](const at::Tensor& t) {
      if (t.defined()) touched.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
    };
    for (size_t i = 0; i < g->params.size(); ++i) {
      add(g->params[i]);
      add(g->grads[i]);
      if (g->masters[i]) add(*g->masters[i]);
      if (g->momentum_buffers[i]) add(*g->momentum_buffers[i]);
    }
    job.touched = std::move(touched);
    job.keep = g->params;
    job.keep.insert(job.keep.end(), g->grads.begin(), g->grads.end());
    job.run = [g, h] { fused_sgd_step(*g, h); };
    return OffloadEngine::get().submit(std::move(job));
  });
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
    job.run = [spec, parts] { spec->validate(std::move(*parts)); };
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
  m.def("_engine_synchronize", [](bool charge_exposed) {
    py::gil_scoped_release no_gil;
    OffloadEngine::get().synchronize(charge_exposed);
  }, py::arg("charge_exposed") = true);
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
  m.def("_engine_snapshot_bytes", &AdamSpeculation::live_snapshot_bytes);
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
