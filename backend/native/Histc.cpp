#include "backend/native/Histc.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "backend/native/Forward.h"

namespace superchip::native {
namespace {

bool integral(const at::Tensor& t) { return c10::isIntegralType(t.scalar_type(), /*includeBool=*/false); }

template <class... Args>
torch::jit::Stack forwarded(const char* name, const char* overload, Args&&... args) {
  static_assert(sizeof...(Args) > 0);
  torch::jit::Stack stack;
  torch::jit::push(stack, std::forward<Args>(args)...);
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  forward_to_executor(op, &stack);
  return stack;
}

}  // namespace

at::Tensor histc(const at::Tensor& self, int64_t bins, const c10::Scalar& min, const c10::Scalar& max) {
  if (!integral(self)) return forwarded("aten::histc", "", self, bins, min, max)[0].toTensor();
  TORCH_CHECK(bins > 0, "bins must be > 0");
  int64_t lo = 0;
  int64_t hi = 0;
  // As CUDA's _histc_cuda_template: the bounds in the input's type.
  AT_DISPATCH_INTEGRAL_TYPES(self.scalar_type(), "superchip_histc", [&] {
    scalar_t mn = static_cast<scalar_t>(min.to<int64_t>());
    scalar_t mx = static_cast<scalar_t>(max.to<int64_t>());
    if (min.to<int64_t>() == max.to<int64_t>() && self.numel() > 0) {
      mn = static_cast<scalar_t>(self.min().item<int64_t>());
      mx = static_cast<scalar_t>(self.max().item<int64_t>());
    }
    if (mn == mx) {
      mn = static_cast<scalar_t>(mn - 1);
      mx = static_cast<scalar_t>(mx + 1);
    }
    lo = mn;
    hi = mx;
  });
  TORCH_CHECK(lo < hi, "max must be larger than min");
  const at::Tensor x = self.reshape(-1).to(at::kLong);
  const at::Tensor in = x.masked_select(x.ge(lo).logical_and_(x.le(hi)));
  const at::Tensor bin = in.sub(lo).mul_(bins).div_(hi - lo, "trunc").clamp_max_(bins - 1);
  return at::bincount(bin, std::nullopt, bins).to(self.scalar_type());
}

at::Tensor& histc_out(const at::Tensor& self, int64_t bins, const c10::Scalar& min, const c10::Scalar& max,
                      at::Tensor& out) {
  if (!integral(self)) {
    forwarded("aten::histc", "out", self, bins, min, max, out);
    return out;
  }
  TORCH_CHECK(out.scalar_type() == self.scalar_type(), "torch.histc: input tensor and output tensor should have "
              "the same dtype, but got input ", self.scalar_type(), " and output ", out.scalar_type());
  const at::Tensor r = histc(self, bins, min, max);
  out.resize_({bins});
  out.copy_(r);
  return out;
}

}  // namespace superchip::native
