#include "backend/runtime/SuperchipGuard.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <utility>

#include "backend/engine/OffloadEngine.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"

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

// Note [Emulated streams]
// Emulated, kernels run synchronously on the calling thread, so every stream is always idle.
// Streams still have identities (0 is the default stream, getNewStream hands out 1..31 in
// turn, as CUDA's pool does) and a per-thread current stream, so code written for CUDA streams
// (FSDP2, record_stream) runs unchanged. An event is the host time at record() plus the stream
// it was recorded on; it is complete unless that stream is *held* (hold_emulated_stream), which
// lets tests show that memory used by a still-running stream is not reused.
constexpr c10::StreamId kPoolSize = 32;

struct HostEvent {
  std::chrono::steady_clock::time_point when;
  c10::StreamId stream = 0;
  c10::DeviceIndex device = 0;
};

std::mutex held_mutex;
std::set<std::pair<c10::DeviceIndex, c10::StreamId>> held_streams;

bool is_held(c10::DeviceIndex device, c10::StreamId id) {
  std::lock_guard<std::mutex> g(held_mutex);
  return held_streams.count({device, id}) > 0;
}

thread_local std::array<c10::StreamId, 64> tls_current_stream{};

Stream host_stream(Device d, c10::StreamId id = 0) {
  return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, resolve_device(d.index())), id);
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
  const c10::DeviceIndex i = resolve_device(d.index());
  return host_stream(d, tls_current_stream[i]);
}

Stream SuperchipGuardImpl::getDefaultStream(Device d) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getDefaultStream(to_cuda(d)));
  return host_stream(d);
}

Stream SuperchipGuardImpl::getStreamFromGlobalPool(Device d, bool high_priority) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getStreamFromGlobalPool(to_cuda(d), high_priority));
  return getNewStream(d, high_priority ? -1 : 0);
}

Stream SuperchipGuardImpl::getNewStream(Device d, int priority) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->getNewStream(to_cuda(d), priority));
  static std::atomic<c10::StreamId> next{0};
  return host_stream(d, 1 + next.fetch_add(1) % (kPoolSize - 1));
}

Stream SuperchipGuardImpl::exchangeStream(Stream s) const {
  if (on_cuda()) return from_executor_stream(cuda_guard()->exchangeStream(to_executor_stream(s)));
  const c10::DeviceIndex i = resolve_device(s.device_index());
  const Stream old = host_stream(s.device(), tls_current_stream[i]);
  tls_current_stream[i] = s.id();
  return old;
}

c10::DeviceIndex SuperchipGuardImpl::deviceCount() const noexcept { return device_count(); }

#if SUPERCHIP_HAS_DEVICE_CAPABILITY
c10::DeviceCapability SuperchipGuardImpl::getDeviceCapability(Device /*d*/) const {
  // Every scalar type but PyTorch's quantized ones (refused), the sub-byte integer types
  // (torch.int1..int7, uint1..uint7: dtype markers of tensor subclasses, whose bytes no CPU
  // kernel copies, so a superchip tensor of them could not be moved off the device), and the
  // opaque bit types and packed fp4 (bits1x8, bits2x4, bits4x2, bits8, bits16,
  // float4_e2m1fn_x2): neither executor's copy converts them to another dtype ("copy_" not
  // implemented for 'Bits8'), which torch.accelerator's capability promises for every type it
  // lists (found by PyTorch's test_accelerator.py run on superchip).
  c10::DeviceCapability cap;
  for (int bit : {c10::kIndex_QInt8, c10::kIndex_QUInt8, c10::kIndex_QInt32, c10::kIndex_QUInt4x2,
                  c10::kIndex_QUInt2x4, c10::kIndex_Int1, c10::kIndex_Int2, c10::kIndex_Int3,
                  c10::kIndex_Int4, c10::kIndex_Int5, c10::kIndex_Int6, c10::kIndex_Int7,
                  c10::kIndex_UInt1, c10::kIndex_UInt2, c10::kIndex_UInt3, c10::kIndex_UInt4,
                  c10::kIndex_UInt5, c10::kIndex_UInt6, c10::kIndex_UInt7, c10::kIndex_Bits1x8,
                  c10::kIndex_Bits2x4, c10::kIndex_Bits4x2, c10::kIndex_Bits8, c10::kIndex_Bits16,
                  c10::kIndex_Float4_e2m1fn_x2}) {
    cap.capability_data.capability_bits &= ~(1ULL << bit);
  }
  return cap;
}
#endif

void SuperchipGuardImpl::record(void** event, const Stream& stream, c10::DeviceIndex device_index,
                                c10::EventFlag flag) const {
  if (on_cuda()) {
    cuda_guard()->record(event, to_executor_stream(stream), device_index, flag);
    return;
  }
  if (*event == nullptr) *event = new HostEvent{};
  auto* e = static_cast<HostEvent*>(*event);
  e->when = std::chrono::steady_clock::now();
  e->stream = stream.id();
  e->device = stream.device_index();
}

void SuperchipGuardImpl::block(void* event, const Stream& stream) const {
  if (on_cuda()) cuda_guard()->block(event, to_executor_stream(stream));
}

bool SuperchipGuardImpl::queryEvent(void* event) const {
  if (on_cuda()) return cuda_guard()->queryEvent(event);
  if (event == nullptr) return true;
  const auto* e = static_cast<const HostEvent*>(event);
  return !is_held(e->device, e->stream);
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
  return !is_held(stream.device_index(), stream.id());
}

void SuperchipGuardImpl::synchronizeStream(const Stream& stream) const {
  if (on_cuda()) cuda_guard()->synchronizeStream(to_executor_stream(stream));
}

void SuperchipGuardImpl::synchronizeEvent(void* event) const {
  if (on_cuda()) cuda_guard()->synchronizeEvent(event);
}

void SuperchipGuardImpl::synchronizeDevice(c10::DeviceIndex device_index) const {
  // The device's work includes the offload engine's queued optimizer steps: every caller
  // (torch.accelerator.synchronize(), device-generic timers, accelerate) waits for them, as
  // torch.superchip.synchronize() does, and gets a failed bucket's error. torch calls this
  // without the GIL, which a job may need. Not from the engine's worker (it would wait for
  // itself).
  if (!OffloadEngine::on_worker()) OffloadEngine::get().synchronize();
  if (on_cuda()) cuda_guard()->synchronizeDevice(device_index);
}

void SuperchipGuardImpl::recordDataPtrOnStream(const c10::DataPtr& data_ptr, const Stream& stream) const {
  superchip_allocator().recordStream(data_ptr, stream);
}

double SuperchipGuardImpl::elapsedTime(void* start, void* end, c10::DeviceIndex device_index) const {
  if (on_cuda()) return cuda_guard()->elapsedTime(start, end, device_index);
  TORCH_CHECK(start && end, "elapsed_time: both events must have been recorded first.");
  const auto dt = static_cast<HostEvent*>(end)->when - static_cast<HostEvent*>(start)->when;
  return std::chrono::duration<double, std::milli>(dt).count();
}

}  // namespace superchip

namespace superchip {

void hold_emulated_stream(c10::DeviceIndex device, c10::StreamId id, bool hold) {
  std::lock_guard<std::mutex> g(held_mutex);
  if (hold) held_streams.insert({device, id});
  else held_streams.erase({device, id});
}

}  // namespace superchip
