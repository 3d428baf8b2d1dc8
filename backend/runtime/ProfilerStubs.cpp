// The legacy profiler's device hooks for superchip: torch.autograd.profiler.profile(use_device=
// "superchip") (and torch.profiler with ProfilerActivity.PrivateUse1 where Kineto has no
// PrivateUse1 plugin) time each operator through torch::profiler::impl::privateuse1Stubs().
//
// Note [Profiler stubs]
// Without them every operator's profiler callback threw "PrivateUse1 used in profiler but not
// enabled" (printed with a C++ stack trace each time, then a Kineto internal assert), the
// recorded times were garbage (cpu_time_total about -1.5e17 us) and a loop of 100 tiny
// forwards took a minute (found by running torch_openreg's own profiler tests on superchip).
// With the CUDA executor the CUDA stubs do the work (CUDA events on the current stream: the
// device's timeline); emulated, kernels run synchronously on the calling thread, so an event
// is the host clock at the call. elapsed() is in microseconds, as the CUDA stubs return it.

#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipGuard.h"

namespace superchip {
namespace {

using torch::profiler::impl::ProfilerStubs;
using torch::profiler::impl::ProfilerVoidEventStub;

const ProfilerStubs* cuda_stubs() {
  const ProfilerStubs* s = torch::profiler::impl::cudaStubs();
  return s != nullptr && s->enabled() ? s : nullptr;
}

struct SuperchipProfilerStubs final : ProfilerStubs {
  void record(c10::DeviceIndex* device, ProfilerVoidEventStub* event, int64_t* cpu_ns) const override {
    if (executor() == Executor::kCuda) {
      if (const ProfilerStubs* cuda = cuda_stubs()) {
        cuda->record(device, event, cpu_ns);
        return;
      }
    }
    if (device != nullptr) *device = current_device();
    const int64_t now = c10::getTime();
    if (event != nullptr) *event = std::make_shared<int64_t>(now);
    if (cpu_ns != nullptr) *cpu_ns = now;
  }

  float elapsed(const ProfilerVoidEventStub* event, const ProfilerVoidEventStub* event2) const override {
    if (executor() == Executor::kCuda) {
      if (const ProfilerStubs* cuda = cuda_stubs()) return cuda->elapsed(event, event2);
    }
    TORCH_CHECK(event != nullptr && *event && event2 != nullptr && *event2,
                "superchip profiler: elapsed() of an event that was not recorded.");
    const int64_t t1 = *static_cast<const int64_t*>(event->get());
    const int64_t t2 = *static_cast<const int64_t*>(event2->get());
    return static_cast<float>(static_cast<double>(t2 - t1) / 1000.0);
  }

  void mark(const char* name) const override {
    if (executor() == Executor::kCuda && cuda_stubs() != nullptr) cuda_stubs()->mark(name);
  }
  void rangePush(const char* name) const override {
    if (executor() == Executor::kCuda && cuda_stubs() != nullptr) cuda_stubs()->rangePush(name);
  }
  void rangePop() const override {
    if (executor() == Executor::kCuda && cuda_stubs() != nullptr) cuda_stubs()->rangePop();
  }

  bool enabled() const override { return true; }

  void onEachDevice(std::function<void(int)> op) const override {
    const c10::DeviceIndex previous = current_device();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      set_current_device(i);
      op(i);
    }
    set_current_device(previous);
  }

  // The device's work, the offload engine's queued steps included (SuperchipGuardImpl).
  void synchronize() const override { SuperchipGuardImpl().synchronizeDevice(current_device()); }
};

struct Register {
  Register() {
    static SuperchipProfilerStubs stubs;
    torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  }
};
const Register registered;

}  // namespace
}  // namespace superchip
