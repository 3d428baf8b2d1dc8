// The native superchip kernels: the few operators the dispatcher cannot forward (factories,
// views and metadata, storage resizing, cross-device copies, scalar reads). Everything else
// goes through forward_to_executor. Registered by register/Registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <array>
#include <optional>
#include <tuple>

namespace superchip::native {

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format);
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory);
// A zero tensor (ZeroTensor key, no memory): what real-valued sgn's backward returns.
at::Tensor efficientzerotensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                              std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                              std::optional<bool> pin_memory);
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset);
at::Tensor view(const at::Tensor& self, c10::IntArrayRef size);
at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride);
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format);
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride);
at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source);
at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source);
at::Tensor& set_empty(at::Tensor& self);
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking);
// A parameter made on the device, which no copy from the CPU marked: a weight when it is a
// floating-point tensor over its whole storage (`place`: placed under hbm's weights limit,
// moving its bytes; see copy_from for the weights that arrive by copy).
void register_weight(const at::Tensor& t, bool place);
// Tensor.record_stream(s): the storage's block is not reused until work queued on `s` so far
// has run (SuperchipAllocator::recordStream).
void record_stream(at::Tensor& self, c10::Stream s);
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst);
c10::Scalar local_scalar_dense(const at::Tensor& self);
// Module.to("superchip") keeps parameter identity (and weight tying) through `.data =`,
// which asks this; c10 counts only its own dense backends as compatible.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from);
// Convolutions reach a PrivateUse1 device through these two "overrideable" ops.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding, int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask);

}  // namespace superchip::native
