// Registration of the superchip device with c10/ATen: allocator, hooks, device guard, the
// native kernels and the forwarding fallback. Thin wrappers only; logic lives in native/ and
// runtime/.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "backend/native/Attention.h"
#include "backend/native/Dropout.h"
#include "backend/native/Forward.h"
#include "backend/native/GroupNorm.h"
#include "backend/native/NormStats.h"
#include "backend/native/Histc.h"
#include "backend/native/Native.h"
#include "backend/native/Rnn.h"
#include "backend/register/Registration.h"
#include "backend/runtime/Runtime.h"
#include "backend/runtime/SuperchipAllocator.h"
#include "backend/runtime/SuperchipGuard.h"
#include "backend/runtime/SuperchipHooks.h"

namespace superchip {
namespace {

struct Registrar {
  Registrar() {
    c10::SetAllocator(c10::DeviceType::PrivateUse1, &superchip_allocator());
    at::RegisterPrivateUse1HooksInterface(new SuperchipHooks());  // lives for the process
  }
};
const Registrar registrar;

// Whether an argument of the schema has the type kind (optional or not).
bool takes(const c10::FunctionSchema& schema, c10::TypeKind kind) {
  for (const auto& arg : schema.arguments()) {
    c10::TypePtr t = arg.real_type();
    if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
    if (t->kind() == kind) return true;
    if (auto list = t->cast<c10::ListType>()) {
      c10::TypePtr e = list->getElementType();
      if (auto opt = e->cast<c10::OptionalType>()) e = opt->getElementType();
      if (e->kind() == kind) return true;
    }
  }
  return false;
}

// Ops taking a Device or a Storage: their composite kernel must stay, as it creates tensors
// on a device or moves bytes across devices.
bool takes_device_or_storage(const c10::FunctionSchema& schema) {
  return takes(schema, c10::TypeKind::DeviceObjType) || takes(schema, c10::TypeKind::StorageType);
}

// Ops whose composite kernel must stay: they create tensors on a device, change devices or
// move bytes across them, or are the native set's own building blocks.
bool forwardable_composite(const c10::FunctionSchema& schema) {
  if (takes_device_or_storage(schema)) return false;
  const std::string& n = schema.name();
  static const char* const kKeep[] = {"copy", "empty", "resize", "_local_scalar_dense", "item",
                                      "lift", "_pin_memory", "is_pinned", "set_", "record_stream",
                                      "_has_compatible_shallow_copy_type", "_to_", "to_"};
  for (const char* k : kKeep) {
    if (n.find(k) != std::string::npos) return false;
  }
  return true;
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, SuperchipGuardImpl);

}  // namespace
}  // namespace superchip

namespace superchip {

// Note [Forwarding composite kernels]
// An op with both an executor kernel and a composite one (CompositeExplicitAutograd,
// ...NonFunctional, or CompositeImplicitAutograd) would run the composite on superchip (it
// outranks the fallback): a decomposition that is slower and gives different bits than the
// executor (native_layer_norm; mish_backward, whose decomposition differs from CPU's kernel in
// the last bit of a quarter of its values; _fused_rms_norm, which F.rms_norm calls and CUDA
// fuses). Those ops are registered to the forwarding kernel explicitly; autograd then takes
// the op's own formula, as on the executor. Ops that create tensors on a device or move bytes
// between devices keep their composite kernels, which route to the native set.
// The `kernel` of a layout's superchip key (`superchip`) for every aten op the executor has a
// kernel of that layout for (`exec`), unless superchip has one. Returns how many.
template <void (*kernel)(const c10::OperatorHandle&, torch::jit::Stack*)>
int register_layout_kernels(c10::DispatchKey exec, c10::DispatchKey superchip) {
  auto* lib = new torch::Library(torch::Library::IMPL, "aten", superchip, __FILE__, __LINE__);  // for the process
  auto& dispatcher = c10::Dispatcher::singleton();
  int count = 0;
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findSchema(name);
    if (!op.has_value() || !op->hasKernelForDispatchKey(exec) || op->hasKernelForDispatchKey(superchip)) continue;
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<kernel>());
    ++count;
  }
  return count;
}

int register_executor_kernels() {
  static torch::Library* lib = nullptr;
  static int count = 0;
  if (lib != nullptr) return count;
  const c10::DispatchKey exec = executor_dispatch_key();
  lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                           __LINE__);  // lives for the process, like the registrations it holds
  if (executor() == Executor::kCpu) {
    // Note [GroupNorm layouts]: the backward gets CPU's memory format back. Before the loop
    // below, which would register the plain forwarding kernel for native_group_norm.
    lib->impl("native_group_norm", TORCH_FN(native::native_group_norm));
    lib->impl("native_group_norm_backward", TORCH_FN(native::native_group_norm_backward));
    // Note [Norm statistics]: CUDA's rules for the saved statistics, as the fake kernels say.
    for (const char* name : native::norm_stats_ops()) {
      lib->impl(name, torch::CppFunction::makeFromBoxedFunction<&native::norm_stats_kernel>());
      ++count;
    }
    // Note [Integer histc]: CUDA's histc counts integers, CPU's does not.
    lib->impl("histc", TORCH_FN(native::histc));
    lib->impl("histc.out", TORCH_FN(native::histc_out));
    count += 4;
  }
  if (native::flash_through_overrideable()) {
    // Note [Attention on superchip]: CUDA's flash kernel, which sdpa reaches from superchip
    // only through this entry.
    lib->impl("_scaled_dot_product_fused_attention_overrideable", TORCH_FN(native::sdpa_overrideable_flash));
    lib->impl("_scaled_dot_product_fused_attention_overrideable_backward",
              TORCH_FN(native::sdpa_overrideable_flash_backward));
    count += 2;
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findSchema(name);
    if (!op.has_value()) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    if (!op->hasKernelForDispatchKey(exec)) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      continue;
    }
    if (!forwardable_composite(op->schema())) continue;
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&forward_to_executor>());
    ++count;
  }
  // Composite kernels that reach a device-specific piece (a DispatchStub, a device-type check)
  // and refuse PrivateUse1; the executor's dispatch slot runs the same composite with it.
  // kaiser_window makes its window with kaiser_window_stub for the output's device: an
  // internal assert ("DispatchStub: missing kernel") on superchip (found by PyTorch's
  // test_tensor_creation_ops). Each overload calls the next one's native function directly.
  for (const char* name : {"mode.values", "conj_physical_", "kaiser_window", "kaiser_window.periodic",
                           "kaiser_window.beta", "kaiser_window.out", "kaiser_window.periodic_out",
                           "kaiser_window.beta_out"}) {
    lib->impl(name, torch::CppFunction::makeFromBoxedFunction<&forward_to_executor>());
    ++count;
  }
  // Note [Nested tensors] and Note [Sparse tensors] (native/Forward.cpp): ops with a nested
  // or sparse kernel on the executor (nested_linear, add_out_dense_sparse, ...) often have a
  // composite one too, which would run for NestedTensorPrivateUse1 / SparsePrivateUse1 ahead
  // of the fallback (and ask a nested tensor for sizes). So each gets the forwarding kernel of
  // its layout, as the executor's keys have their own.
  const bool cuda = executor() == Executor::kCuda;
  count += register_layout_kernels<&forward_nested_to_executor>(
      cuda ? c10::DispatchKey::NestedTensorCUDA : c10::DispatchKey::NestedTensorCPU,
      c10::DispatchKey::NestedTensorPrivateUse1);
  count += register_layout_kernels<&forward_sparse_to_executor>(
      cuda ? c10::DispatchKey::SparseCUDA : c10::DispatchKey::SparseCPU, c10::DispatchKey::SparsePrivateUse1);
  count += register_layout_kernels<&forward_sparse_compressed_to_executor>(
      cuda ? c10::DispatchKey::SparseCsrCUDA : c10::DispatchKey::SparseCsrCPU,
      c10::DispatchKey::SparseCsrPrivateUse1);
  if (executor() == Executor::kCpu) {
    // Note [Fused RNN cells]: ATen's RNN cells take the fused path for any non-CPU input.
    static torch::Library* autograd_lib = new torch::Library(
        torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
    autograd_lib->impl("_thnn_fused_lstm_cell", TORCH_FN(native::fused_lstm_cell_decomposed));
    autograd_lib->impl("_thnn_fused_gru_cell", TORCH_FN(native::fused_gru_cell_decomposed));
    // Note [Dropout on the CPU executor]: the CPU's dropout, not the fused one.
    autograd_lib->impl("dropout", TORCH_FN(native::dropout_as_on_cpu));
    count += 3;
  }
  return count;
}

// Note [Other libraries' operators]
// An operator another library defines (torch.library: bitsandbytes' dequantize_4bit and its
// optimizers, torchao's, a user's custom_op) often has a kernel per device and a "default"
// one, registered as CompositeExplicitAutograd. On superchip the default outranked the
// forwarding fallback, so the executor's kernel never ran: bitsandbytes' 32-bit AdamW gave
// other bits than on the CPU, and on the CUDA executor every bitsandbytes op would have run
// its pure-torch default instead of its CUDA kernel. Such an op takes the forwarding kernel,
// as aten's do (Note [Forwarding composite kernels]); the executor then runs whatever it
// would run for its own tensors, its kernel or, lacking one, the same default. Operators are
// registered at any time, so the Python side (superchip/_library.py) asks at import and after
// each torch.library registration, and ties each forwarding registration to the lifetime of
// the library whose registration called for it.
namespace {
std::optional<c10::OperatorHandle> find_op(const std::string& name) {
  const auto colon = name.find("::");
  if (colon == std::string::npos) return std::nullopt;
  const auto dot = name.find('.', colon + 2);
  c10::OperatorName op_name(name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1));
  return c10::Dispatcher::singleton().findSchema(op_name);
}
}  // namespace

bool executor_kernel_outranked(const std::string& name) {
  if (name.rfind("aten::", 0) == 0) return false;  // register_executor_kernels' own
  auto op = find_op(name);
  if (!op.has_value()) return false;  // not defined (yet, or any more)
  if (!op->hasKernelForDispatchKey(executor_dispatch_key())) return false;
  if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
      !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) &&
      !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    return false;
  }
  // A factory (a Device argument, no tensor) is reached at superchip's key only through its
  // BackendSelect kernel, which custom_op registers and superchip/_library.py points at
  // superchip for a device="superchip" call (Note [Factories of other libraries]); the
  // forwarding kernel then passes the executor's device to the executor's kernel. An op taking
  // tensors and a Device may move them across devices: its composite stays.
  const c10::FunctionSchema& schema = op->schema();
  if (takes(schema, c10::TypeKind::StorageType)) return false;
  return !takes(schema, c10::TypeKind::DeviceObjType) || !takes(schema, c10::TypeKind::TensorType);
}

std::vector<std::string> outranked_executor_kernels() {
  std::vector<std::string> names;
  for (const c10::OperatorName& n : c10::Dispatcher::singleton().getAllOpNames()) {
    const std::string name = n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
    if (!executor_kernel_outranked(name)) continue;
    auto op = find_op(name);
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;  // superchip's own
    names.push_back(name);
  }
  return names;
}

std::unique_ptr<torch::Library> register_forwarding(const std::string& name) {
  const auto colon = name.find("::");
  TORCH_CHECK(colon != std::string::npos, "superchip: '", name, "' is not a qualified operator name.");
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, name.substr(0, colon),
                                              c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  lib->impl(name.substr(colon + 2).c_str(), torch::CppFunction::makeFromBoxedFunction<&forward_to_executor>());
  return lib;
}

}  // namespace superchip

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace superchip::native;
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("_efficientzerotensor", TORCH_FN(efficientzerotensor));
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("view", TORCH_FN(view));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  m.impl("set_.source_Storage", TORCH_FN(set_source_storage));
  m.impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  m.impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
  m.impl("record_stream", TORCH_FN(record_stream));
}

// Before the Python key: a tensor subclass on superchip (torchao's NF4Tensor) was asked this
// by Module.to("superchip") and raised NotImplementedError (CPU's composite kernel runs at
// the autograd key, which our backend kernel displaces).
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(superchip::native::has_compatible_shallow_copy_type));
}

// Cross-device copies of conjugate / negative views resolve the bit inside the copy itself
// (the executor's copy_ does); materialising first would recurse back into _copy_from.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&superchip::forward_to_executor>());
}

TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&superchip::forward_nested_to_executor>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&superchip::forward_sparse_to_executor>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&superchip::forward_sparse_compressed_to_executor>());
}

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&superchip::refuse_quantized>());
}
