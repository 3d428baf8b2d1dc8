// The offload engine's GPU ordering under the CUDA executor (Note [Engine jobs and GPU
// streams] in engine/OffloadEngine.cpp), installed into the engine when the backend loads. Kept
// out of OffloadEngine.cpp, which its concurrency tests build alone, without the runtime.

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "backend/engine/OffloadEngine.h"
#include "backend/runtime/Runtime.h"

namespace superchip {
namespace {

using Storages = std::vector<c10::intrusive_ptr<c10::StorageImpl>>;

// The superchip devices `touched` lives on, each once.
std::vector<c10::DeviceIndex> devices_of(const Storages& touched) {
  std::vector<c10::DeviceIndex> devices;
  for (const auto& s : touched) {
    if (s->device().type() != c10::DeviceType::PrivateUse1) continue;
    const c10::DeviceIndex d = s->device().index();
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  }
  return devices;
}

// Events on the calling thread's current CUDA stream of each device `touched` lives on.
std::vector<std::shared_ptr<c10::Event>> record_ready_events(const Storages& touched) {
  std::vector<std::shared_ptr<c10::Event>> events;
  if (executor() != Executor::kCuda) return events;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  for (c10::DeviceIndex d : devices_of(touched)) {
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
    // Only devices this process has used: a pool stream creates a context (hundreds of MB of
    // every GPU, for each rank of a torchrun that sees them all). A device first used later
    // keeps the default stream: ordered still, overlapped less.
    if (!at::detail::getCUDAHooks().hasPrimaryContext(d)) continue;
    cuda->exchangeStream(cuda->getStreamFromGlobalPool(c10::Device(c10::DeviceType::CUDA, d)));
  }
}

// After each job, on the worker: what the job queued on the worker's streams of the devices it
// touched has run before the job counts as done. Copies between superchip tensors (a gradient
// snapshot into a host block, a strided write-back into a parameter) are CUDA device-to-device
// copies, which never block the CPU; the next job (a CPU step) or the next forward would read
// their destination early. Found by review; not yet run on a GPU.
void finish_side_streams(const Storages& touched) {
  if (executor() != Executor::kCuda) return;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  for (c10::DeviceIndex d : devices_of(touched)) {
    cuda->synchronizeStream(cuda->getStream(c10::Device(c10::DeviceType::CUDA, d)));
  }
}

const bool installed = [] {
  OffloadEngine::get().set_gpu_order(&record_ready_events, &use_side_streams, &finish_side_streams);
  return true;
}();

}  // namespace
}  // namespace superchip
