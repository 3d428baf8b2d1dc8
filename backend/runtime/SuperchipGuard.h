// SuperchipGuardImpl: device guard of the superchip device type. With the CUDA executor it
// forwards devices, streams and events to c10's CUDA guard and re-tags them as superchip;
// emulated, kernels run synchronously and streams are identities (Note [Emulated streams]).
// Keeps the c10 contract: deviceCount() and the noexcept methods never throw.
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>

// torch 2.13 asks a device guard for its DeviceCapability; 2.11 may predate it.
#if __has_include(<c10/core/DeviceCapability.h>)
#define SUPERCHIP_HAS_DEVICE_CAPABILITY 1
#else
#define SUPERCHIP_HAS_DEVICE_CAPABILITY 0
#endif

namespace superchip {

struct SuperchipGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType static_type = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return static_type; }
  c10::Device exchangeDevice(c10::Device d) const override;
  c10::Device getDevice() const override;
  void setDevice(c10::Device d) const override;
  void uncheckedSetDevice(c10::Device d) const noexcept override;
  c10::Stream getStream(c10::Device d) const override;
  c10::Stream getDefaultStream(c10::Device d) const override;
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority = false) const override;
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override;
  c10::Stream exchangeStream(c10::Stream s) const override;
  c10::DeviceIndex deviceCount() const noexcept override;
#if SUPERCHIP_HAS_DEVICE_CAPABILITY
  // torch.accelerator.get_device_capability(): the dtypes a superchip tensor can hold and be
  // copied in (not PyTorch's quantized ones, refused: Note [Quantized tensors]).
  c10::DeviceCapability getDeviceCapability(c10::Device d) const override;
#endif
  void record(void** event, const c10::Stream& stream, c10::DeviceIndex device_index,
              c10::EventFlag flag) const override;
  void block(void* event, const c10::Stream& stream) const override;
  bool queryEvent(void* event) const override;
  void destroyEvent(void* event, c10::DeviceIndex device_index) const noexcept override;
  bool queryStream(const c10::Stream& stream) const override;
  void synchronizeStream(const c10::Stream& stream) const override;
  void synchronizeEvent(void* event) const override;
  void synchronizeDevice(c10::DeviceIndex device_index) const override;
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& stream) const override;
  double elapsedTime(void* start, void* end, c10::DeviceIndex device_index) const override;
};

// A superchip stream <-> the executor's stream with the same id (CUDA executor only).
c10::Stream to_executor_stream(const c10::Stream& s);
c10::Stream from_executor_stream(const c10::Stream& s);

// Emulated executor only: while held, events recorded on stream `id` of `device` and the
// stream itself report "still running" (tests of stream-ordered memory reuse).
void hold_emulated_stream(c10::DeviceIndex device, c10::StreamId id, bool hold);

}  // namespace superchip
