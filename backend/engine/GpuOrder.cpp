// The offload engine's GPU ordering under the CUDA executor (Note [Engine jobs and GPU
// streams] in engine/OffloadEngine.cpp), installed into the engine when the backend loads. Kept
// out of OffloadEngine.cpp, which its concurrency tests build alone, without the runtime.

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <memory>
#include <vector>

#include "backend/engine/OffloadEngine.h"
#include "backend/runtime/Runtime.h"

namespace superchip {
namespace {

// Events on the calling thread's current CUDA stream of each device `touched` lives on.
std::vector<std::shared_ptr<c10::Event>> record_ready_events(
    const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& touched) {
  std::vector<std::shared_ptr<c10::Event>> events;
  if (executor() != Executor::kCuda) return events;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  std::vector<c10::DeviceIndex> devices;
  for (const auto& s : touched) {
    if (s->device().type() != c10::DeviceType::PrivateUse1) continue;
    const c10::DeviceIndex d = s->device().index();
    bool seen = false;
    for (c10::DeviceIndex x : devices) seen |= x == d;
    if (seen) continue;
    devices.push_back(d);
    auto e = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    e->record(cuda->getStream(c10::Device(c10::DeviceType::CUDA, d)));
    events.push_back(std::move(e));
  }
  return events;
}

// The worker's current CUDA stream on every device: a pool stream, not the default stream the
// training thread queues on.
void use_side_streams() {
  if (executor() != Executor::kCuda) return;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  for (c10::DeviceIndex d = 0; d < device_count(); ++d) {
    cuda->exchangeStream(cuda->getStreamFromGlobalPool(c10::Device(c10::DeviceType::CUDA, d)));
  }
}

const bool installed = [] {
  OffloadEngine::get().set_gpu_order(&record_ready_events, &use_side_streams);
  return true;
}();

}  // namespace
}  // namespace superchip
