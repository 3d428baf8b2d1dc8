// Registration of the superchip device with c10/ATen: allocator, hooks, device guard, the
// native kernels and the forwarding fallback. Thin wrappers only; logic lives in native/ and
// runtime/.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "backend/native/Forward.h"
#include "backend/native/Native.h"
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

C10_REGISTER_GUARD_IMPL(PrivateUse1, SuperchipGuardImpl);

}  // namespace
}  // namespace superchip

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace superchip::native;
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
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
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&superchip::forward_to_executor>());
}
