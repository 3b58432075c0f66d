#pragma once
// Element math of Adam and AdamW in float32, as torch.optim's single-tensor path computes it: every
// per-step scalar is derived in double (as Python does) and rounded to float once.
#include <cmath>

#include "hd.h"

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

/// Per-step float constants, computed once per launch from the 1-based step t.
struct AdamStep {
  float decay_factor;           ///< 1 - lr * weight_decay (AdamW)
  float l2;                     ///< weight_decay (Adam)
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float step_size;              ///< lr / (1 - beta1^t)
  float bias_correction2_sqrt;  ///< sqrt(1 - beta2^t)
  float grad_factor;            ///< multiplies the gradient as it is read (1 / loss scale, clipping)
  bool decoupled;
  bool amsgrad;
  bool maximize;
  bool has_weight_decay;
};

GPUOPS_HD AdamStep make_adam_step(const AdamHyper& h, double t, float grad_factor) {
  AdamStep s;
  s.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.l2 = static_cast<float>(h.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.step_size = static_cast<float>(h.lr / (1.0 - pow(h.beta1, t)));
  s.bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(h.beta2, t)));
  s.grad_factor = grad_factor;
  s.decoupled = h.decoupled;
  s.amsgrad = h.amsgrad;
  s.maximize = h.maximize;
  s.has_weight_decay = h.weight_decay != 0.0;
  return s;
}

/// One parameter element. max_exp_avg_sq is read and written only with amsgrad.
GPUOPS_HD void adam_update(float& param, float grad, float& exp_avg, float& exp_avg_sq, float& max_exp_avg_sq,
                           const AdamStep& s) {
  if (s.grad_factor != 1.0f) grad *= s.grad_factor;
  if (s.maximize) grad = -grad;
  if (s.has_weight_decay) {
    if (s.decoupled) {
      param *= s.decay_factor;
    } else {
      grad += s.l2 * param;
    }
  }
  exp_avg += s.one_minus_beta1 * (grad - exp_avg);  // torch's lerp_(grad, 1 - beta1)
  exp_avg_sq = exp_avg_sq * s.beta2 + s.one_minus_beta2 * grad * grad;
  float second = exp_avg_sq;
  if (s.amsgrad) {
    max_exp_avg_sq = fmaxf(max_exp_avg_sq, exp_avg_sq);
    second = max_exp_avg_sq;
  }
  const float denom = sqrtf(second) / s.bias_correction2_sqrt + s.eps;
  param += -s.step_size * (exp_avg / denom);
}

}  // namespace gpuops::math
