#pragma once
// Element math of Adam and AdamW in float32, as torch.optim's single-tensor path computes it: every
// per-step scalar is derived in double (as Python does) and rounded to float once.
#include <cmath>

#include "hd.h"
#if !defined(__CUDACC__)
#include "float8.h"  // the CPU loops' 8-wide values, for the templates below
#endif

namespace gpuops::math {

/// The optimizer's hyper-parameters, as the user gave them.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;  ///< AdamW (decay the weight) rather than Adam (L2: weight_decay * param added to grad)
  bool amsgrad = false;
  bool maximize = false;
};

/// Per-step float constants, computed once per launch from the 1-based step t. The options are folded into
/// multipliers (1 or 0 where an option is off) so that the element update has no branch and vectorizes;
/// multiplying by 1 and adding 0 are exact, so the result is the one the branching form gives.
struct AdamStep {
  float grad_multiplier;        ///< grad_factor (1 / loss scale, clipping), negated with maximize
  float decay_factor;           ///< 1 - lr * weight_decay for AdamW, else 1
  float l2;                     ///< weight_decay for Adam (added to the gradient), else 0
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float step_size;              ///< lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt;  ///< 1 / sqrt(1 - beta2^t), rounded once: a multiply, not a divide, per element
};

/// base^t for a whole t >= 0 by repeated squaring: multiplies only, each rounded as IEEE says on host and
/// device alike, so both get the same bits (the device's pow is only within 2 ulp of glibc's).
GPUOPS_HD double whole_power(double base, double t) {
  double result = 1.0;
  for (auto n = static_cast<unsigned long long>(t); n != 0; n >>= 1) {
    if (n & 1) result *= base;
    base *= base;
  }
  return result;
}

GPUOPS_HD AdamStep make_adam_step(const AdamHyper& h, double t, float grad_factor) {
  AdamStep s;
  s.grad_multiplier = h.maximize ? -grad_factor : grad_factor;
  s.decay_factor = h.decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.l2 = h.decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.step_size = static_cast<float>(h.lr / (1.0 - whole_power(h.beta1, t)));
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / sqrt(1.0 - whole_power(h.beta2, t)));
  return s;
}

/// Square root of a float (float8.h has the 8-wide one).
GPUOPS_HD float sqrt_of(float x) { return sqrtf(x); }

/// The first and second moments of one element (T = float), or of 8 at once (T = a GCC vector of 8 floats:
/// the same operations in the same order, so the same bits); returns the updated parameter's decayed value
/// and leaves the denominator's input (exp_avg_sq, or its running maximum with amsgrad) to the caller.
template <typename T>
GPUOPS_HD T adam_moments(T param, T grad, T& exp_avg, T& exp_avg_sq, const AdamStep& s) {
  grad = grad * s.grad_multiplier + s.l2 * param;
  exp_avg += s.one_minus_beta1 * (grad - exp_avg);  // torch's lerp_(grad, 1 - beta1)
  exp_avg_sq = exp_avg_sq * s.beta2 + s.one_minus_beta2 * grad * grad;
  return param * s.decay_factor;
}

template <typename T>
GPUOPS_HD T adam_apply(T decayed_param, T exp_avg, T second_moment, const AdamStep& s) {
  // One divide per element, not two: torch's fused CPU AdamW also departs from its for-loop's rounding
  // (about 8% of elements by 1 ulp) to save work; the tests bound the error against float64 instead.
  const T denom = sqrt_of(second_moment) * s.inv_bias_correction2_sqrt + s.eps;
  return decayed_param + -s.step_size * (exp_avg / denom);
}

/// One parameter element without amsgrad.
GPUOPS_HD void adam_update(float& param, float grad, float& exp_avg, float& exp_avg_sq, const AdamStep& s) {
  const float decayed = adam_moments(param, grad, exp_avg, exp_avg_sq, s);
  param = adam_apply(decayed, exp_avg, exp_avg_sq, s);
}

/// One parameter element with amsgrad: the denominator uses the running maximum of exp_avg_sq.
GPUOPS_HD void adam_update_amsgrad(float& param, float grad, float& exp_avg, float& exp_avg_sq, float& max_exp_avg_sq,
                                   const AdamStep& s) {
  const float decayed = adam_moments(param, grad, exp_avg, exp_avg_sq, s);
  max_exp_avg_sq = fmaxf(max_exp_avg_sq, exp_avg_sq);
  param = adam_apply(decayed, exp_avg, max_exp_avg_sq, s);
}

}  // namespace gpuops::math
