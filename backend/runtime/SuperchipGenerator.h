// SuperchipGenerator: the random generator of a superchip device. It wraps an executor
// generator and forwards every call to it; forwarded RNG kernels receive that inner generator.
// The default one wraps the executor's default generator (the CPU's emulated, the CUDA
// device's with the CUDA executor), because kernels without a generator argument draw from
// that; torch.Generator(device="superchip") wraps a fresh one.
// Thread-safety: as c10::GeneratorImpl (callers lock mutex_; the inner one is locked by kernels).
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

namespace superchip {

class SuperchipGenerator final : public c10::GeneratorImpl {
 public:
  SuperchipGenerator(c10::DeviceIndex index, at::Generator inner);

  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;

  const at::Generator& inner() const { return inner_; }

 private:
  SuperchipGenerator* clone_impl() const override;
  mutable at::Generator inner_;  // mutable: const readers still lock its mutex
};

// Default generator of superchip:index (created on first use).
const at::Generator& default_generator(c10::DeviceIndex index);
// A fresh generator of superchip:index with its own state.
at::Generator new_generator(c10::DeviceIndex index);
// The executor generator a forwarded kernel must use for `gen` (a superchip generator).
at::Generator executor_generator(const at::Generator& gen);

}  // namespace superchip
