// adam_step_ref / sgd_step_ref: the textbook torch.optim formulas in double, one element at a
// time, rounded to the storage types only when stored. The tests hold every path to these
// within the per-dtype tolerances of test/cpp/ops/OpsTestUtil.h.
#include <cmath>

#include "ops/cpu/FusedOptim.h"
#include "ops/cpu/LowPrecision.h"
#include "ops/cpu/StepKernels.h"

namespace superchip::ops {
namespace {

double grad_at(const void* g, DType d, int64_t i) {
  switch (d) {
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
    case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

void store_lowp(void* dst, DType d, int64_t i, double x) {
  if (dst == nullptr) return;
  static_cast<uint16_t*>(dst)[i] = d == DType::kBF16 ? double_to_bf16_ref(x) : double_to_fp16_ref(x);
}

// torch.maximum: NaN if either is NaN.
double max_nan(double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::fmax(a, b); }

}  // namespace

void adam_step_ref(const AdamHyper& h, const AdamArrays& a) {
  detail::check_adam_args(h, a);
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  for (int64_t i = 0; i < a.n; ++i) {
    double g = grad_at(a.grad, a.grad_dtype, i);
    if (h.maximize) g = -g;
    double p = a.param[i];
    if (h.weight_decay != 0.0) {
      if (h.decoupled_weight_decay) {
        p *= 1.0 - h.lr * h.weight_decay;
      } else {
        g += h.weight_decay * p;
      }
    }
    const double m = a.exp_avg[i] + (1.0 - h.beta1) * (g - a.exp_avg[i]);
    const double v = h.beta2 * a.exp_avg_sq[i] + (1.0 - h.beta2) * g * g;
    double v_hat = v;
    if (h.amsgrad) {
      v_hat = max_nan(a.max_exp_avg_sq[i], v);
      a.max_exp_avg_sq[i] = static_cast<float>(v_hat);
    }
    const double denom = std::sqrt(v_hat) / std::sqrt(bias_correction2) + h.eps;
    p -= h.lr / bias_correction1 * m / denom;
    a.param[i] = static_cast<float>(p);
    a.exp_avg[i] = static_cast<float>(m);
    a.exp_avg_sq[i] = static_cast<float>(v);
    store_lowp(a.param_lowp, a.lowp_dtype, i, p);
  }
}

void sgd_step_ref(const SgdHyper& h, const SgdArrays& a) {
  detail::check_sgd_args(h, a);
  for (int64_t i = 0; i < a.n; ++i) {
    double g = grad_at(a.grad, a.grad_dtype, i);
    if (h.maximize) g = -g;
    double p = a.param[i];
    if (h.weight_decay != 0.0) g += h.weight_decay * p;
    if (h.momentum != 0.0) {
      double buf = g;
      if (!h.first_step) buf = h.momentum * a.momentum_buffer[i] + (1.0 - h.dampening) * g;
      a.momentum_buffer[i] = static_cast<float>(buf);
      g = h.nesterov ? g + h.momentum * buf : buf;
    }
    p -= h.lr * g;
    a.param[i] = static_cast<float>(p);
    store_lowp(a.param_lowp, a.lowp_dtype, i, p);
  }
}

}  // namespace superchip::ops
