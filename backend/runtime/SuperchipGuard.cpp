#include "backend/runtime/SuperchipGuard.h"

#include <c10/util/Exception.h>

#include <chrono>

#include "backend/runtime/Runtime.h"

namespace superchip {
namespace {

using c10::Device;
using c10::DeviceType;
using c10::Stream;

const c10::impl::DeviceGuardImplInterface* cuda_guard() {
  return c10::impl::getDeviceGuardImpl(DeviceType::CUDA);
}

bool on_cuda() { return executor() == Executor::kCuda; }

Device to_cuda(Device d) { return Device(DeviceType::CUDA, d.index()); }

// Emulated events: the host time at record(); work on the single host stream is synchronous,
// so an event is complete as soon as it is recorded.
struct HostEvent {
  std::chrono::steady_clock::time_point when;
};

Stream host_stream(Device d) {
  return Stream(Stream::DEFAULT, Device(DeviceType::PrivateUse1, resolve_device(d.index())));
}

}  // namespace

Stream to_executor_stream(const Stream& s) {
  return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, s.device_index()), s.id());
}

Stream from_executor_stream(const Stream& s) {
  return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, s.device_index()), s.id());
}

Device SuperchipGuardImpl::exchangeDevice(Device d) const {
  TORCH_INTERNAL_ASSERT(d.type() == DeviceType::PrivateUse1);
  const Device old = getDevice();
  if (old.index() != d.index()) setDevice(d);
  return old;
}

Device SuperchipGuardImpl::getDevice() const {
  return Device(DeviceType::PrivateUse1, current_device());
}

void SuperchipGuardImpl::setDevice(Device d) const {
  TORCH_INTERNAL_ASSERT(d.type() == DeviceType::PrivateUse1);
  set_current_device(d.index());
}

void SuperchipGuardImpl::uncheckedSetDevice(Device d) const noexcept {
  try {
    set_current_device(d.index());
  } catch (...) {
  }
}

Stream SuperchipGuardImpl::getStream(Device d) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getStream(to_cuda(d)));
  return host_stream(d);
}

Stream SuperchipGuardImpl::getDefaultStream(Device d) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getDefaultStream(to_cuda(d)));
  return host_stream(d);
}

Stream SuperchipGuardImpl::getStreamFromGlobalPool(Device d, bool high_priority) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getStreamFromGlobalPool(to_cuda(d), high_priority));
  return host_stream(d);
}

Stream SuperchipGuardImpl::getNewStream(Device d, int priority) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getNewStream(to_cuda(d), priority));
  return host_stream(d);
}

Stream SuperchipGuardImpl::exchangeStream(Stream s) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->exchangeStream(to_executor_stream(s)));
  return host_stream(s.device());
}

c10::DeviceIndex SuperchipGuardImpl::deviceCount() const noexcept { return device_count(); }

void SuperchipGuardImpl::record(void** event, const Stream& stream, c10::DeviceIndex device_index,
                                c10::EventFlag flag) const {
  if (on_cuda()) {
    cuda_guard()->record(event, to_executor_stream(stream), device_index, flag);
    return;
  }
  if (*event == nullptr) *event = new HostEvent{};
  static_cast<HostEvent*>(*event)->when = std::chrono::steady_clock::now();
}

void SuperchipGuardImpl::block(void* event, const Stream& stream) const {
  if (on_cuda()) cuda_guard()->block(event, to_executor_stream(stream));
}

bool SuperchipGuardImpl::queryEvent(void* event) const {
  if (on_cuda()) return cuda_guard()->queryEvent(event);
  return true;
}

void SuperchipGuardImpl::destroyEvent(void* event, c10::DeviceIndex device_index) const noexcept {
  if (event == nullptr) return;
  try {
    if (on_cuda()) {
      cuda_guard()->destroyEvent(event, device_index);
      return;
    }
  } catch (...) {
    return;
  }
  delete static_cast<HostEvent*>(event);
}

bool SuperchipGuardImpl::queryStream(const Stream& stream) const {
  if (on_cuda()) return cuda_guard()->queryStream(to_executor_stream(stream));
  return true;
}

void SuperchipGuardImpl::synchronizeStream(const Stream& stream) const {
  if (on_cuda()) cuda_guard()->synchronizeStream(to_executor_stream(stream));
}

void SuperchipGuardImpl::synchronizeEvent(void* event) const {
  if (on_cuda()) cuda_guard()->synchronizeEvent(event);
}

void SuperchipGuardImpl::synchronizeDevice(c10::DeviceIndex device_index) const {
  if (on_cuda()) cuda_guard()->synchronizeDevice(device_index);
}

void SuperchipGuardImpl::recordDataPtrOnStream(const c10::DataPtr& data_ptr, const Stream& stream) const {
  (void)data_ptr;
  (void)stream;  // the superchip allocator reuses memory on the stream that freed it
}

double SuperchipGuardImpl::elapsedTime(void* start, void* end, c10::DeviceIndex device_index) const {
  if (on_cuda()) return cuda_guard()->elapsedTime(start, end, device_index);
  TORCH_CHECK(start && end, "elapsed_time: both events must have been recorded first.");
  const auto dt = static_cast<HostEvent*>(end)->when - static_cast<HostEvent*>(start)->when;
  return std::chrono::duration<double, std::milli>(dt).count();
}

}  // namespace superchip
