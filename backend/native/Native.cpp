#include "backend/native/Native.h"

#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/Resize.h>
#include <ATen/native/ResizeCommon.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <initializer_list>

#include "backend/native/Forward.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/WriteWatch.h"
#include "backend/stream/WeightStreamer.h"

namespace superchip::native {
namespace {

c10::DeviceIndex device_of(std::optional<c10::Device> device) {
  if (!device.has_value()) return current_device();
  TORCH_CHECK(device->type() == c10::DeviceType::PrivateUse1,
              "superchip factory called with device ", *device);
  return resolve_device(device->index());
}

void check_factory_args(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided,
              "superchip tensors support layout=torch.strided only, got ", *layout, ".");
  TORCH_CHECK(!pin_memory.value_or(false),
              "pin_memory=True applies to CPU tensors only; superchip tensors are device memory.");
}

// Makes the storage of `impl` large enough for its sizes, strides and offset.
void ensure_storage_bytes(c10::TensorImpl* impl) {
  if (impl->numel() == 0) return;
  const size_t needed = at::detail::computeStorageNbytes(impl->sizes(), impl->strides(),
                                                         impl->dtype().itemsize(),
                                                         impl->storage_offset());
  const c10::Storage& storage = impl->unsafe_storage();
  if (needed > storage.nbytes()) resize_storage_bytes(*storage.unsafeGetStorageImpl(), needed);
}

bool is_superchip(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

bool is_executor_or_cpu(const at::Tensor& t) {
  return t.device().is_cpu() || t.device().type() == executor_device_type();
}

// Inside a torch.autocast region (enabled or not): its casts of weights are per-pass copies.
// Not is_autocast_enabled(), which is false inside autocast's own kernels, where the casts run.
bool in_autocast_region() {
  at::autocast::increment_nesting();
  return at::autocast::decrement_nesting() > 0;
}

// Under torch.use_deterministic_algorithms(True) (with torch.utils.deterministic.
// fill_uninitialized_memory, its default), new memory is filled with NaN, or the integer
// maximum, as CPU and CUDA do.
bool fills_uninitialized() {
  const at::Context& ctx = at::globalContext();
  return C10_UNLIKELY(ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory());
}

// Covers all of its storage's bytes, each once.
bool fills_storage(const at::Tensor& t) {
  return t.storage_offset() == 0 && t.is_non_overlapping_and_dense() &&
         static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
}

// Note [Quantized weights]
// A weight's bytes: floating point, or one-byte integers, the data of a quantized weight
// (torchao's int8 weight-only and NF4 tensors keep int8 / uint8 data beside float scales).
// Token ids, labels and masks (int64, int32, bool) are never taken for weights. Before, a
// quantized base moved to the device put its int8 data in host, never streamed (read in
// place by every pass, found by review). A tensor subclass (a wrapper such as NF4Tensor)
// has no bytes of its own: its inner tensors are the weights (superchip/__init__.py
// registers them); registering the wrapper copied from its null data (a segfault, when
// hbm was past its weights limit).
bool weight_dtype(const at::Tensor& t) {
  const c10::ScalarType d = t.scalar_type();
  return t.is_floating_point() || d == c10::ScalarType::Char || d == c10::ScalarType::Byte;
}

bool python_subclass(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python);
}

}  // namespace

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_factory_args(layout, pin_memory);
  const c10::DeviceIndex index = device_of(device);
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, index));
  at::Tensor t = at::detail::empty_generic(size, &superchip_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype), memory_format);
  if (fills_uninitialized()) at::native::fill_empty_deterministic_(t);
  return t;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_factory_args(layout, pin_memory);
  const c10::DeviceIndex index = device_of(device);
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, index));
  at::Tensor t = at::detail::empty_strided_generic(size, stride, &superchip_allocator(),
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                   c10::dtype_or_default(dtype));
  if (fills_uninitialized()) at::native::fill_empty_deterministic_(t);
  return t;
}

at::Tensor efficientzerotensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                              std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                              std::optional<bool> pin_memory) {
  check_factory_args(layout, pin_memory);
  at::detail::check_size_nonnegative(size);
  const c10::DeviceIndex index = device_of(device);
  return superchip_zero_tensor(size, c10::contiguous_strides(size),
                               c10::scalarTypeToTypeMeta(c10::dtype_or_default(dtype)), index);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  const int64_t old_nbytes = impl->has_storage() ? static_cast<int64_t>(impl->unsafe_storage().nbytes()) : 0;
  at::native::resize_impl_cpu_(impl, size, /*stride=*/std::nullopt, /*resize_storage=*/false);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "Unsupported memory format ", *memory_format, " for resize_.");
    impl->empty_tensor_restride(*memory_format);
  }
  ensure_storage_bytes(impl);
  if (fills_uninitialized()) at::native::fill_resize_deterministic_(self, old_nbytes);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  at::native::checkSetStorage(self, std::move(source), storage_offset, size, stride);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  at::OptionalIntArrayRef st = stride.data() != nullptr ? at::OptionalIntArrayRef(stride) : std::nullopt;
  at::native::resize_impl_cpu_(impl, size, st, /*resize_storage=*/false);
  ensure_storage_bytes(impl);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0,
                     allocate_in_tier(0, Tier::kHbm, self.device().index()), &superchip_allocator(),
                     /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

// Note [Batches while streaming]
// A float tensor copied in whole from the CPU is taken for a weight (placed under hbm's weights
// limit, marked), since that is how models arrive. A float batch arrives the same way, every
// step: while weights stream, hbm holds the stationary weights up to that limit plus the
// staging arena, so each batch was moved to host and then copied at use by the first layer's
// forward and backward, or read in place (on a GPU, over the link), although hbm had room for
// it. So while a plan is followed and all its weights are alive, such a copy stays where the
// allocator put it (hbm while hbm has room, else host); it is still marked, and recording
// still tells batches from weights (Note [Inputs are not weights]). A model moved in while
// another streams lands in hbm too until hbm is full, then in host; its reads outside the order
// start a new recording, whose plan demotes what must stream (WeightStreamer::apply). Before
// any plan, and once a planned weight died (the model that streamed is gone), copies are
// placed as weights.

// Note [Copies of weights read in place]
// A weight copied whole into another storage outside autocast (which makes that one a weight
// too, see copy_from) is read where it lives, not staged through hbm (stream/WeightStreamer.h),
// and the read is not recorded in the order of weight reads. Such copies are a loader's, before
// the first pass: a meta-initialised model's to_empty parameters filled by p.copy_(w) from
// weights put on the device, or model.bfloat16() on the device. Recorded, the first of them
// began the recording, so the model's own parameters, marked after it, were young (Note
// [Inputs are not weights]): the first plan came from a broken trace and was redone. The same
// holds for a copy out of the device (.cpu(), a state_dict or checkpoint save mid-training): it
// reads each byte once, so staging a host weight through hbm first moved it twice (22 staged
// copies for one save of the streamed test Llama), and the read is no use of the weight. Other
// copies read through the streamer as any operator does: autocast's per-pass casts are the
// forward's reads of its fp32 weights.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(is_superchip(self) || is_executor_or_cpu(self),
              "copy between superchip and ", self.device(), " is not supported; go through the cpu.");
  TORCH_CHECK(is_superchip(dst) || is_executor_or_cpu(dst),
              "copy between superchip and ", dst.device(), " is not supported; go through the cpu.");
  // Weights arriving from the CPU that fill their whole storage (.to("superchip"),
  // torch.load(map_location=...), load_state_dict), whole weights cast on the device
  // (model.to("superchip").bfloat16()), or whole weights copied on the device (a meta-initialised
  // model's to_empty(device="superchip") parameters filled by p.copy_(w) from weights a loader
  // put on the device): placed under hbm's weights limit. Autocast's per-forward casts of
  // weights are not weights. Only a cast is known to be a model's (of_model): a same-dtype copy
  // may be a pass's scratch copy of a weight, which must stay young (Note [Inputs are not
  // weights]).
  // Not an integer weight's cast: a quantized weight's per-pass dequantization (Note
  // [Quantized weights]), which would start the recording over at every pass.
  const bool copy_of_weight =
      is_superchip(self) && is_superchip(dst) && self.is_floating_point() && fills_storage(self) && fills_storage(dst) &&
      !in_autocast_region() && WeightStreamer::get().is_weight(self.storage().unsafeGetStorageImpl());
  const bool cast_of_weight = copy_of_weight && self.scalar_type() != dst.scalar_type();
  if (is_superchip(dst) && fills_storage(dst) && (!is_superchip(self) || copy_of_weight)) {
    // Note [Batches while streaming]: not moved to host while a live plan is followed.
    const bool batch = !is_superchip(self) && WeightStreamer::get().following_live_plan();
    // Placing gives dst new, unwritten bytes: never while they are the source too (a weight
    // copied onto itself, as FSDP2's set_state_dict does with a state dict of the parameters
    // themselves: hbm past its limit, the weight came back as garbage, found by review).
    const bool onto_itself = is_superchip(self) && self.storage().unsafeGetStorageImpl() ==
                                                       dst.storage().unsafeGetStorageImpl();
    if (!batch && !onto_itself) place_incoming_weights(*dst.storage().unsafeGetStorageImpl());
    // Not integer batches (token ids, labels): Note [Quantized weights].
    if (weight_dtype(dst)) {
      WeightStreamer::get().mark_weight(*dst.storage().unsafeGetStorageImpl(), /*of_model=*/cast_of_weight);
    }
  }
  // One AliasSet: a source overlapping the destination is seen as on CPU. A weight copied
  // whole into a new weight, and anything copied out of the device, is read in place (Note
  // [Copies of weights read in place]).
  AliasSet aliases;
  const bool read_in_place = copy_of_weight || (is_superchip(self) && !is_superchip(dst));
  at::Tensor src_x =
      is_superchip(self) ? aliases.alias(self, read_in_place ? Access::kCopySource : Access::kRead) : self;
  at::Tensor dst_x = is_superchip(dst) ? aliases.alias(dst, Access::kWrite) : dst;
  if (is_superchip(dst)) note_write(dst.storage().unsafeGetStorageImpl());  // runtime/WriteWatch.h
  const bool crosses_link = executor() == Executor::kCuda && src_x.device() != dst_x.device();
  if (crosses_link && src_x.scalar_type() != dst_x.scalar_type()) {
    // Cast-then-move, fixed rule until the link-cost model lands: the narrower dtype is the
    // one that crosses the link, so the cast runs on the side that holds the wider one.
    if (dst_x.element_size() < src_x.element_size()) {
      dst_x.copy_(src_x.to(dst_x.scalar_type()), /*non_blocking=*/false);
    } else {
      at::Tensor staged = at::empty(src_x.sizes(), src_x.options().device(dst_x.device()));
      staged.copy_(src_x, /*non_blocking=*/false);
      dst_x.copy_(staged, /*non_blocking=*/false);
    }
    return dst;
  }
  dst_x.copy_(src_x, non_blocking);
  return dst;
}

void register_weight(const at::Tensor& t, bool place) {
  if (!is_superchip(t) || !weight_dtype(t) || t.layout() != c10::kStrided || python_subclass(t) ||
      !t.has_storage() || !fills_storage(t)) {
    return;  // Note [Quantized weights]
  }
  c10::StorageImpl& storage = *t.storage().unsafeGetStorageImpl();
  if (storage.data() == nullptr) return;
  // Marked already (copied in from the CPU): now known to be a model's (a parameter an optimizer
  // steps, Note [Inputs reused for a few passes]); placed when it came.
  const bool marked = WeightStreamer::get().is_weight(&storage);
  if (place && !marked) place_registered_weight(storage);
  WeightStreamer::get().mark_weight(storage, /*of_model=*/true);
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (is_superchip(dst)) {
    resize_(dst, self.sizes(), std::nullopt);
  } else {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, /*non_blocking=*/false);
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::_local_scalar_dense(executor_alias(self, Access::kRead));
}

bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) return true;
  // A tensor subclass (torchao's NF4Tensor) answers as on CPU: Module._apply swaps those.
  if (python_subclass(self) || python_subclass(from)) return false;
  auto dense = [](const at::Tensor& t) {
    const c10::DeviceType d = t.device().type();
    return t.layout() == c10::kStrided && !t.is_quantized() && !t.is_nested() &&
           (d == c10::DeviceType::PrivateUse1 || d == c10::DeviceType::CPU || d == c10::DeviceType::CUDA);
  };
  return dense(self) && dense(from);
}

// Convolution reaches superchip through ATen's overrideable hooks, not the forwarding fallback,
// so the fallback's device check (ForwardedCall::find_device) is made here: a weight or bias
// left on the CPU (a module not moved) or on another superchip device is refused as every
// forwarded operator refuses it. Aliased as it was, the CPU kernel computed the forward, and
// backward failed later on the CPU weight's gradient.
namespace {
void check_convolution_devices(const char* op, const at::Tensor& input,
                               std::initializer_list<const at::Tensor*> others) {
  for (const at::Tensor* t : others) {
    if (t == nullptr || !t->defined() || t->device() == input.device()) continue;
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                "devices, ", input.device(), " and ", t->device(), "! (in ", op, "). Move them "
                "to one device with .to(): a module's weights with module.to(\"superchip\").");
  }
}
}  // namespace

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding, int64_t groups) {
  check_convolution_devices("aten::convolution", input,
                            {&weight, bias.has_value() ? &*bias : nullptr});
  std::optional<at::Tensor> bias_x;
  if (bias.has_value() && bias->defined()) bias_x = executor_alias(*bias, Access::kRead);
  at::Tensor out = at::convolution(executor_alias(input, Access::kRead),
                                   executor_alias(weight, Access::kRead), bias_x, stride,
                                   padding, dilation, transposed, output_padding, groups);
  return retag_result(out, input.device().index());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  check_convolution_devices("aten::convolution_backward", input, {&grad_output, &weight});
  // The bias gradient has one value per output channel.
  const int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
  std::vector<int64_t> bias_sizes{out_channels};
  auto [gi, gw, gb] = at::convolution_backward(
      executor_alias(grad_output, Access::kRead), executor_alias(input, Access::kRead),
      executor_alias(weight, Access::kRead),
      output_mask[2] ? at::OptionalIntArrayRef(bias_sizes) : std::nullopt, stride, padding,
      dilation, transposed, output_padding, groups, output_mask);
  const c10::DeviceIndex device = input.device().index();
  auto tag = [device](const at::Tensor& t) { return t.defined() ? retag_result(t, device) : t; };
  return {tag(gi), tag(gw), tag(gb)};
}

void record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(s.device_type() == c10::DeviceType::PrivateUse1, "record_stream: a superchip tensor "
              "can be recorded on a superchip stream only, got a stream of ", s.device(),
              ". Use torch.superchip.current_stream() or torch.superchip.Stream().");
  superchip_allocator().recordStream(self.storage().data_ptr(), s);
}

}  // namespace superchip::native
