#include "backend/runtime/SuperchipHooks.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/SuperchipGenerator.h"

namespace superchip {

bool SuperchipHooks::isAvailable() const { return device_count() > 0; }

const at::Generator& SuperchipHooks::getDefaultGenerator(c10::DeviceIndex device_index) const {
  return default_generator(device_index);
}

at::Generator SuperchipHooks::getNewGenerator(c10::DeviceIndex device_index) const {
  return new_generator(device_index);
}

at::Device SuperchipHooks::getDeviceFromPtr(void* data) const {
  for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
    MemoryManager* m = memory_if_created(i);
    if (m && m->tier_of(data).has_value()) return {c10::DeviceType::PrivateUse1, i};
  }
  // Adopted executor memory is not the manager's; it belongs to the current device.
  return {c10::DeviceType::PrivateUse1, current_device()};
}

// With the CUDA executor, pinned memory is CUDA's own page-locked host allocator, so
// non_blocking copies get its event tracking; emulated, the superchip pinned pool.
bool SuperchipHooks::isPinnedPtr(const void* data) const {
  if (executor() == Executor::kCuda) return at::detail::getCUDAHooks().isPinnedPtr(data);
  return is_pinned_ptr(data);
}

at::Allocator* SuperchipHooks::getPinnedMemoryAllocator() const {
  if (executor() == Executor::kCuda) return at::detail::getCUDAHooks().getPinnedMemoryAllocator();
  return pinned_allocator();
}

bool SuperchipHooks::hasPrimaryContext(c10::DeviceIndex device_index) const {
  return device_index >= 0 && device_index < device_count();
}

c10::DeviceIndex SuperchipHooks::deviceCount() const { return device_count(); }

void SuperchipHooks::setCurrentDevice(c10::DeviceIndex device) const { set_current_device(device); }

c10::DeviceIndex SuperchipHooks::getCurrentDevice() const { return current_device(); }

c10::DeviceIndex SuperchipHooks::exchangeDevice(c10::DeviceIndex device) const {
  const c10::DeviceIndex old = current_device();
  if (device >= 0 && device != old) set_current_device(device);
  return old;
}

c10::DeviceIndex SuperchipHooks::maybeExchangeDevice(c10::DeviceIndex device) const {
  return exchangeDevice(device);
}

void SuperchipHooks::resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const {
  resize_storage_bytes(*storage.unsafeGetStorageImpl(), new_bytes);
}

}  // namespace superchip
