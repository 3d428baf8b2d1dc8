#include "backend/runtime/SuperchipGenerator.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <mutex>

#include "backend/runtime/Runtime.h"

namespace superchip {
namespace {

constexpr int kMaxDevices = 64;

at::Generator make_inner(c10::DeviceIndex index, bool fresh) {
  if (executor() == Executor::kCuda) {
    const auto& hooks = at::detail::getCUDAHooks();
    return fresh ? hooks.getNewGenerator(index) : hooks.getDefaultGenerator(index);
  }
  // Emulated, the default generator is the CPU's own: forwarded kernels without a generator
  // argument (native_dropout) draw from it, so one stream serves every op and seeding it
  // through torch.superchip or torch.manual_seed controls them all.
  return fresh ? at::detail::createCPUGenerator(c10::default_rng_seed_val)
               : at::detail::getDefaultCPUGenerator();
}

}  // namespace

SuperchipGenerator::SuperchipGenerator(c10::DeviceIndex index, at::Generator inner)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      inner_(std::move(inner)) {}

void SuperchipGenerator::set_current_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(inner_.mutex());
  inner_.set_current_seed(seed);
}
void SuperchipGenerator::set_offset(uint64_t offset) {
  std::lock_guard<std::mutex> lock(inner_.mutex());
  inner_.set_offset(offset);
}
uint64_t SuperchipGenerator::get_offset() const { return inner_.get_offset(); }
uint64_t SuperchipGenerator::current_seed() const { return inner_.current_seed(); }
uint64_t SuperchipGenerator::seed() {
  std::lock_guard<std::mutex> lock(inner_.mutex());
  return inner_.seed();
}
void SuperchipGenerator::set_state(const c10::TensorImpl& new_state) {
  std::lock_guard<std::mutex> lock(inner_.mutex());
  inner_.unsafeGetGeneratorImpl()->set_state(new_state);
}
c10::intrusive_ptr<c10::TensorImpl> SuperchipGenerator::get_state() const {
  std::lock_guard<std::mutex> lock(inner_.mutex());
  return inner_.unsafeGetGeneratorImpl()->get_state();
}
SuperchipGenerator* SuperchipGenerator::clone_impl() const {
  return new SuperchipGenerator(device().index(), inner_.clone());
}

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::array<at::Generator, kMaxDevices> gens;
  static std::array<std::once_flag, kMaxDevices> flags;
  index = resolve_device(index);
  std::call_once(flags[index], [index] {
    gens[index] = at::make_generator<SuperchipGenerator>(index, make_inner(index, /*fresh=*/false));
  });
  return gens[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  index = resolve_device(index);
  return at::make_generator<SuperchipGenerator>(index, make_inner(index, /*fresh=*/true));
}

at::Generator executor_generator(const at::Generator& gen) {
  TORCH_CHECK(gen.device().type() == c10::DeviceType::PrivateUse1,
              "Expected a 'superchip' device type for generator but found '", gen.device().type(),
              "'. Create it with torch.Generator(device='superchip').");
  return gen.get<SuperchipGenerator>()->inner();
}

}  // namespace superchip
