// superchip._C bindings of the weight streamer (backend/stream/): thin argument conversion.
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include "backend/native/Native.h"
#include "backend/stream/WeightStreamer.h"

namespace py = pybind11;

namespace superchip {
namespace {

// WeightStreamer::ApplyRequest: a plan has demotions or promotions; superchip schedules
// apply() before the next module call (python/superchip/__init__.py). Runs inside an operator,
// which ATen's Python bindings call with the GIL released: take it, as torch's own refcounting
// does.
void schedule_apply() noexcept {
  if (Py_IsInitialized() == 0) return;
  try {
    py::gil_scoped_acquire gil;
    try {
      py::module_::import("superchip").attr("_apply_stream_plan_at_next_module")();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("superchip: scheduling the weight plan's tier moves");
    }
  } catch (...) {
    // Nothing scheduled: the optimizer step hook still applies the plan in training loops.
  }
}

// (storage id, bytes, streamed) per entry; Python maps the ids to parameter names.
py::list entries(const std::vector<StreamPlanEntry>& es) {
  py::list l;
  for (const StreamPlanEntry& e : es) {
    l.append(py::make_tuple(reinterpret_cast<uintptr_t>(e.storage), e.nbytes, e.streamed));
  }
  return l;
}

}  // namespace

void bind_stream(py::module& m) {
  WeightStreamer::get().set_apply_request_hook(&schedule_apply);
  m.def("_stream_stats", [] {
    const StreamStats s = WeightStreamer::get().stats();
    py::dict d;
    d["staged_copies"] = s.staged_copies;
    d["staged_bytes"] = s.staged_bytes;
    d["prefetched"] = s.prefetched;
    d["hits"] = s.hits;
    d["prefetch_waits"] = s.prefetch_waits;
    d["staged_at_use"] = s.staged_at_use;
    d["in_place_reads"] = s.in_place_reads;
    d["invalidated"] = s.invalidated;
    d["mispredictions"] = s.mispredictions;
    d["plans"] = s.plans;
    d["staging_bytes"] = s.staging_bytes;
    d["staging_peak_bytes"] = s.staging_peak_bytes;
    d["copy_seconds"] = s.copy_seconds;
    return d;
  });
  m.def("_stream_reset_stats", [] { WeightStreamer::get().reset_stats(); });
  // A parameter registered on a module (`place`: placed under hbm's weights limit) or stepped
  // by an optimizer: one made on the device is a weight (streamed from host), like one copied
  // in whole from the CPU.
  m.def("_register_weight", &native::register_weight, py::arg("tensor"), py::arg("place"));
  m.def("_stream_plan", [] {
    const StreamPlan p = WeightStreamer::get().plan();
    py::dict d;
    d["state"] = p.state;
    d["mode"] = p.mode;
    d["version"] = p.version;
    d["order"] = entries(p.order);
    d["row_reads"] = entries(p.row_reads);
    d["streamed_bytes"] = p.streamed_bytes;
    d["hbm_capacity"] = p.hbm_capacity;
    d["activation_peak_bytes"] = p.activation_peak_bytes;
    d["staging_budget"] = p.staging_budget;
    d["demoted"] = p.demoted;
    d["promoted"] = p.promoted;
    d["prefetch_depth"] = p.prefetch_depth;
    d["copy_bytes_per_s"] = p.copy_bytes_per_s;
    return d;
  });
  m.def("_stream_set_enabled", [](bool on) { WeightStreamer::get().set_enabled(on); });
  m.def("_stream_enabled", [] { return WeightStreamer::get().enabled(); });
  // Without the GIL: apply() waits for the engine's jobs on the weights it moves, and a job may
  // need the GIL (see _engine_wait_inputs).
  m.def("_stream_apply", [] { return WeightStreamer::get().apply(); }, py::call_guard<py::gil_scoped_release>());
  m.def("_stream_replan", [] { WeightStreamer::get().replan(); });
}

}  // namespace superchip
