#include "backend/native/Dropout.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace superchip::native {

at::Tensor dropout_as_on_cpu(const at::Tensor& input, double p, bool train) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (p == 0 || !train || input.sym_numel() == 0) return input;
  if (p == 1) return input.mul(at::zeros({}, input.options()));
  // The CPU's order: one bernoulli draw per element into a tensor of the input's dtype, then
  // the scale in that dtype, then the product (the ops autograd differentiates).
  at::Tensor noise = at::empty_like(input);
  noise.bernoulli_(1 - p);
  noise.div_(1 - p);
  return input.mul(noise);
}

}  // namespace superchip::native
