// superchip._C: the Python entry points. Thin: argument conversion and calls into runtime/.
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <map>
#include <string>

#include <pybind11/stl.h>

#include "allocator/Backing.h"
#include "allocator/HostMemory.h"
#include "allocator/Topology.h"
#include "backend/distributed/ProcessGroupSccl.h"
#include "backend/native/Forward.h"
#include "backend/optim/FusedStep.h"
#include "ops/cpu/Bandwidth.h"
#include "backend/register/Registration.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/SuperchipGenerator.h"
#include "backend/runtime/SuperchipGuard.h"
#include "backend/runtime/StorageLease.h"
#include "backend/runtime/WriteWatch.h"
#include "backend/stream/WeightStreamer.h"

namespace py = pybind11;

namespace superchip {

void bind_engine(py::module& m);  // EngineModule.cpp
void bind_stream(py::module& m);  // StreamModule.cpp

namespace {

Tier tier_arg(const std::string& name) {
  auto t = parse_tier(name);
  TORCH_CHECK(t.has_value(), "tier must be 'hbm' or 'host', got '", name, "'.");
  return *t;
}

void check_superchip(const at::Tensor& t, const char* fn) {
  TORCH_CHECK(t.defined(), fn, ": expected a tensor, got an undefined one.");
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, fn,
              ": expected a superchip tensor, got one on ", t.device(),
              ". Move it with .to('superchip') first.");
}

// The storage behind a superchip tensor, for the tier calls. A tensor subclass that wraps
// others (made by _make_wrapper_subclass) has none: reading it crashed the process (a DTensor,
// found by review; Python's tier_of/move_to_tier pass a DTensor's local shard).
c10::StorageImpl& storage_of(const at::Tensor& t, const char* fn) {
  check_superchip(t, fn);
  c10::StorageImpl* s = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  TORCH_CHECK(s != nullptr && (s->data() != nullptr || s->nbytes() == 0), fn, ": this tensor "
              "has no storage of its own (a tensor subclass that wraps others?). "
              "Pass the tensor that holds its bytes (a DTensor's to_local()).");
  return *s;
}

py::dict memory_stats(c10::DeviceIndex device) {
  MemoryManager& m = memory(resolve_device(device));
  py::dict d;
  for (Tier tier : {Tier::kHbm, Tier::kHost}) {
    const TierStats s = m.stats(tier);
    const std::string p = std::string(tier_name(tier)) + ".";
    d[py::str(p + "allocated_bytes")] = s.allocated_bytes;
    d[py::str(p + "requested_bytes")] = s.requested_bytes;
    d[py::str(p + "reserved_bytes")] = s.reserved_bytes;
    d[py::str(p + "peak_allocated_bytes")] = s.peak_allocated_bytes;
    d[py::str(p + "peak_reserved_bytes")] = s.peak_reserved_bytes;
    d[py::str(p + "peak_requested_bytes")] = s.peak_requested_bytes;
    d[py::str(p + "peak_active_allocations")] = s.peak_active_allocations;
    d[py::str(p + "capacity_bytes")] = s.capacity_bytes;
    d[py::str(p + "external_bytes")] = s.external_bytes;
    d[py::str(p + "active_allocations")] = s.active_allocations;
    d[py::str(p + "num_allocs")] = s.num_allocs;
    d[py::str(p + "num_frees")] = s.num_frees;
    d[py::str(p + "num_cache_hits")] = s.num_cache_hits;
    d[py::str(p + "num_ooms")] = s.num_ooms;
    if (tier == Tier::kHost) d[py::str(p + "num_spills")] = s.num_spills;
  }
  return d;
}

// An fp32 superchip tensor shaped like `like`, in `tier`, holding `like`'s values (or zeros).
at::Tensor fp32_in_tier(const at::Tensor& like, const std::string& tier, bool copy_values) {
  check_superchip(like, "superchip._C._fp32_in_tier");
  const c10::DeviceIndex device = like.device().index();
  const size_t nbytes = static_cast<size_t>(like.numel()) * sizeof(float);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       allocate_in_tier(nbytes, tier_arg(tier), device), &superchip_allocator(),
                       /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      caffe2::TypeMeta::Make<float>());
  impl->set_sizes_contiguous(like.sizes());
  at::Tensor t(std::move(impl));
  if (copy_values) {
    copy_through_aliases(t, like);  // optimizer state: not a weight (copy_from would place it)
  } else {
    t.zero_();
  }
  return t;
}

}  // namespace
}  // namespace superchip

PYBIND11_MODULE(_C, m) {
  using namespace superchip;
  m.doc() = "superchip native module (see superchip/__init__.py for the public API)";
  m.def("_init", [] {
    (void)executor();  // raises here, as a Python error, when SUPERCHIP_EXECUTOR is invalid
    check_environment();  // and the other variables read at start-up (runtime/Runtime.h)
    WeightStreamer::check_environment();
    (void)optimizer_threads_from_env();
    return register_executor_kernels();
  });
  // Note [Other libraries' operators] (register/Registration.cpp). A registration is undone by
  // destroy() (called by torch.library's Library, which holds it in _registration_handles) or
  // when the Python object goes; destroy() twice is fine.
  struct ForwardingRegistration {
    std::unique_ptr<torch::Library> lib;
  };
  py::class_<ForwardingRegistration>(m, "_ForwardingRegistration")
      .def("destroy", [](ForwardingRegistration& r) { r.lib.reset(); })
      .def_property_readonly("alive", [](const ForwardingRegistration& r) { return r.lib != nullptr; });
  m.def("_executor_kernel_outranked", &executor_kernel_outranked);
  m.def("_outranked_executor_kernels", &outranked_executor_kernels);
  m.def("_register_forwarding",
        [](const std::string& name) { return ForwardingRegistration{register_forwarding(name)}; });
  m.def("_executor", [] { return std::string(executor_name(executor())); });
  m.def("_device_count", [] { return static_cast<int>(device_count()); });
  m.def("_current_device", [] { return static_cast<int>(current_device()); });
  m.def("_set_device", [](int i) { set_current_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("_memory_stats", [](int device) { return memory_stats(static_cast<c10::DeviceIndex>(device)); });
  // The engine's finished jobs and the streamer's staged copies too (SuperchipAllocator::emptyCache).
  m.def("_empty_cache", [] { superchip_allocator().emptyCache(); });
  // What torch reads of the accelerator's host allocator (Note [The host allocator]): the bytes
  // of live pinned blocks and the bytes held from the system (live + cached).
  m.def("_host_allocator_stats", [] {
    const at::HostStats s = at::getHostAllocator(c10::DeviceType::PrivateUse1)->get_stats();
    return std::map<std::string, int64_t>{{"active_bytes", s.active_bytes.current},
                                          {"reserved_bytes", s.allocated_bytes.current},
                                          {"num_host_alloc", s.num_host_alloc},
                                          {"num_host_free", s.num_host_free}};
  });
  m.def("_reset_peak_memory_stats", [](int device) {
    memory(resolve_device(static_cast<c10::DeviceIndex>(device))).reset_peak();
  });
  // Note [The staging arena gives way]
  // While weights stream, the streamer's staging arena holds what hbm had free (plus staged
  // copies): lowering hbm's budget below that, or moving a weight into hbm by hand, failed
  // with "free tensors first" although no tensor of the user's held the bytes, and
  // empty_cache() did not help (found by review). Such a request now drops the plan and its
  // arena and is tried once more; the next pass plans again for the budget it finds.
  m.def("_parse_bytes", [](const std::string& text, const std::string& what) {
    return static_cast<int64_t>(parse_bytes(text, what.c_str()));
  });
  m.def("_set_capacity", [](int device, const std::string& tier, int64_t bytes) {
    TORCH_CHECK(bytes >= 0, "capacity must be >= 0 bytes (0 = unlimited), got ", bytes, ".");
    MemoryManager& mm = memory(resolve_device(static_cast<c10::DeviceIndex>(device)));
    const Tier t = tier_arg(tier);
    for (int attempt = 0;; ++attempt) {
      try {
        mm.set_capacity(t, static_cast<size_t>(bytes));
        return;
      } catch (const std::invalid_argument& e) {
        if (attempt == 0 && t == Tier::kHbm && WeightStreamer::get().enabled()) {
          WeightStreamer::get().replan();
          WeightStreamer::get().release_staging();
          mm.empty_cache();
          continue;
        }
        TORCH_CHECK(false, e.what());
      }
    }
  });
  m.def("_check_invariants", [](int device) {
    memory(resolve_device(static_cast<c10::DeviceIndex>(device))).check_invariants();
  });
  m.def("_tier_of", [](const at::Tensor& t) {
    return std::string(tier_name(storage_tier(storage_of(t, "superchip.tier_of"))));
  });
  m.def("_move_to_tier", [](const at::Tensor& t, const std::string& tier) {
    c10::StorageImpl& storage = storage_of(t, "superchip.move_to_tier");
    const Tier target = tier_arg(tier);
    py::gil_scoped_release no_gil;
    // A quiet attempt first, so an out-of-memory error is counted (num_ooms) only when one
    // is raised (it counted two for one error).
    if (!try_move_storage_to_tier(storage, target)) {
      if (target == Tier::kHbm && WeightStreamer::get().enabled()) {
        // Note [The staging arena gives way]
        WeightStreamer::get().replan();
        WeightStreamer::get().release_staging();
      }
      move_storage_to_tier(storage, target);  // raises with the reason (no room, a lease)
    }
    WeightStreamer::get().note_placed_by_hand(t.storage().unsafeGetStorageImpl());
  });
  m.def("_default_generator", [](int device) {
    return default_generator(static_cast<c10::DeviceIndex>(device));
  });
  m.def("_synchronize", [](int device) {
    const auto index = resolve_device(static_cast<c10::DeviceIndex>(device));
    py::gil_scoped_release no_gil;
    c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->synchronizeDevice(index);
  });
  m.def("_fp32_in_tier", &fp32_in_tier, py::arg("like"), py::arg("tier"), py::arg("copy_values"));
  // Optimizer state filled from a parameter or a checkpoint: the backend's copy, not a user's
  // copy_ (no weight placement or marks).
  m.def("_copy_into_state", [](const at::Tensor& state, const at::Tensor& values) {
    check_superchip(state, "superchip._C._copy_into_state");
    TORCH_CHECK(state.sizes() == values.sizes(), "superchip._C._copy_into_state: shapes differ (",
                state.sizes(), " vs ", values.sizes(), ").");
    copy_through_aliases(state, values);
  }, py::arg("state"), py::arg("values"));
  // Writes a tensor's version counter does not show (through .data): runtime/WriteWatch.h.
  m.def("_watch_writes", [](const at::Tensor& t) {
    if (t.device().type() == c10::DeviceType::PrivateUse1 && t.has_storage()) {
      watch_writes(*t.storage().unsafeGetStorageImpl());
    }
  }, py::arg("tensor"));
  m.def("_writes_noted", [](const at::Tensor& t) -> uint64_t {
    if (t.device().type() != c10::DeviceType::PrivateUse1 || !t.has_storage()) return 0;
    return writes_noted(*t.storage().unsafeGetStorageImpl());
  }, py::arg("tensor"));
  m.def("_watched_storage_count", &watched_storage_count);
  m.def("_stream_triad_inplace", [](at::Tensor& a, const at::Tensor& b, double s) {
    for (const at::Tensor* t : {static_cast<const at::Tensor*>(&a), &b}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == a.numel(),
                  "superchip._C._stream_triad_inplace: expects two contiguous float32 CPU "
                  "tensors of one size.");
    }
    float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    const int64_t n = a.numel();
    py::gil_scoped_release no_gil;
    ops::stream_triad_inplace(pa, pb, static_cast<float>(s), n, &optimizer_pool());
  });
  m.def("_adam_traffic_floor", [](at::Tensor& p, const at::Tensor& g, at::Tensor& m1, at::Tensor& m2) {
    for (const at::Tensor* t : {static_cast<const at::Tensor*>(&p), &g, static_cast<const at::Tensor*>(&m1),
                                static_cast<const at::Tensor*>(&m2)}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == p.numel(),
                  "superchip._C._adam_traffic_floor: expects four contiguous float32 CPU tensors "
                  "of one size.");
    }
    float* pp = p.data_ptr<float>();
    const float* pg = g.data_ptr<float>();
    float* pm = m1.data_ptr<float>();
    float* pv = m2.data_ptr<float>();
    const int64_t n = p.numel();
    py::gil_scoped_release no_gil;
    ops::adam_traffic_floor(pp, pg, pm, pv, n, &optimizer_pool());
  });
  m.def("_optimizer_threads", &optimizer_threads);
  m.def("_optimizer_simd_path", [] { return std::string(optimizer_simd_path()); });
  // ---- distributed (python/superchip/distributed.py builds the inner group) ----
  py::class_<ProcessGroupSccl::SccOptions, c10d::Backend::Options,
             c10::intrusive_ptr<ProcessGroupSccl::SccOptions>>(m, "ProcessGroupScclOptions")
      .def("__copy__", [](const ProcessGroupSccl::SccOptions& o) {
        return c10::make_intrusive<ProcessGroupSccl::SccOptions>(o);
      })
      .def("__deepcopy__", [](const ProcessGroupSccl::SccOptions& o, py::dict) {
        return c10::make_intrusive<ProcessGroupSccl::SccOptions>(o);
      });
  py::class_<ProcessGroupSccl, c10d::Backend, c10::intrusive_ptr<ProcessGroupSccl>>(m, "ProcessGroupSccl")
      .def_property_readonly("options", [](ProcessGroupSccl& self) {
        return c10::static_intrusive_pointer_cast<ProcessGroupSccl::SccOptions>(self.getBackendOptions());
      })
      .def_property_readonly("inner", &ProcessGroupSccl::inner)
      // torch's new_group, on a rank the new group leaves out, when the world group is bound to
      // a device and splits: the inner group takes part in the split as NCCL requires of every
      // rank (its performNocolorSplit, on the executor's device); an inner group without it
      // (Gloo) has nothing to do. Before, an AttributeError on that rank.
      .def("perform_nocolor_split", [](ProcessGroupSccl& self, const c10::Device& device) {
        py::object inner = py::cast(self.inner());
        if (py::hasattr(inner, "perform_nocolor_split")) {
          inner.attr("perform_nocolor_split")(executor_device(device.index()));
        }
      });
  m.def("_create_sccl_backend",
        [](c10::intrusive_ptr<c10d::Backend> inner, int rank, int size, double timeout_s,
           py::object split_options) {
          ProcessGroupSccl::InnerSplitOptionsFn fn;
          if (!split_options.is_none()) {
            // Calls python/superchip/distributed.py:_inner_split_options under the GIL; the
            // shared_ptr lets the function outlive this call without leaking the object.
            auto callable = std::shared_ptr<py::object>(new py::object(split_options), [](py::object* o) {
              if (!Py_IsInitialized()) return;  // after interpreter exit: leak, never touch Python
              py::gil_scoped_acquire gil;
              delete o;
            });
            fn = [callable](const c10::intrusive_ptr<c10d::Backend>& in, const c10d::Backend::Options& o) {
              py::gil_scoped_acquire gil;
              py::object r = (*callable)(in, o.group_name, o.group_desc,
                                         std::chrono::duration<double>(o.timeout).count());
              return r.cast<c10::intrusive_ptr<c10d::Backend::Options>>();
            };
          }
          return c10::make_intrusive<ProcessGroupSccl>(
              std::move(inner), rank, size,
              std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0)), std::move(fn));
        },
        py::arg("inner"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
        py::arg("split_options") = py::none());
  m.def("_sccl_inner", [](const c10::intrusive_ptr<c10d::Backend>& b) {
    auto* s = dynamic_cast<ProcessGroupSccl*>(b.get());
    TORCH_CHECK(s != nullptr, "expected an sccl backend, got '", b->getBackendName(), "'.");
    return s->inner();
  });
  m.def("_hold_emulated_stream", [](int device, int64_t id, bool hold) {
    hold_emulated_stream(static_cast<c10::DeviceIndex>(device), static_cast<c10::StreamId>(id), hold);
  });
  m.def("_pending_stream_frees", [] { return pending_stream_frees(); });
  m.def("_leased_storage_count", [] { return leased_storage_count(); });
  m.def("_topology", [] { return Topology::get().describe(); });
  // What the machine can still give this process (Note [The machine's memory]): the host
  // tier's bound where it has no budget; "" where the kernel's figures cannot be read.
  m.def("_host_memory", [] {
    const std::optional<HostMemory> m = read_host_memory();
    if (!m) return std::string();
    return m->describe() + "; superchip leaves " + format_bytes(host_memory_reserve(m->limit())) +
           " of it free";
  });
  // The same figures as numbers, for the engine's admission of speculation where the host tier
  // has no budget (Note [Speculation and host memory] in python/superchip/engine.py): what a
  // new block can still take, what superchip leaves free, and superchip's blocks not yet
  // written (which the headroom does not show yet). None where the figures cannot be read.
  m.def("_host_memory_figures", []() -> py::object {
    const std::optional<HostMemory> m = read_host_memory();
    if (!m) return py::none();
    py::dict d;
    d["headroom"] = m->headroom();
    d["reserve"] = host_memory_reserve(m->limit());
    d["unwritten"] = host_blocks_unwritten_bytes();
    return d;
  });
  bind_engine(m);
  bind_stream(m);
}
