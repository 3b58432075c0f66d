#pragma once
// Element math of SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD computes
// it; scalars are derived in double and rounded to float once.
#include "hd.h"

namespace gpuops::math {

struct SgdHyper {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

struct SgdStep {
  float neg_lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  float grad_factor;
  bool first;  ///< the momentum buffer starts as the first step's gradient (no dampening)
  bool nesterov;
  bool maximize;
};

GPUOPS_HD SgdStep make_sgd_step(const SgdHyper& h, bool first, float grad_factor) {
  return {static_cast<float>(-h.lr), static_cast<float>(h.momentum), static_cast<float>(1.0 - h.dampening),
          static_cast<float>(h.weight_decay), grad_factor, first, h.nesterov, h.maximize};
}

/// One parameter element; `buf` is the momentum buffer (untouched when momentum is 0).
GPUOPS_HD void sgd_update(float& param, float grad, float& buf, const SgdStep& s) {
  float d = grad;
  if (s.grad_factor != 1.0f) d *= s.grad_factor;
  if (s.maximize) d = -d;
  if (s.weight_decay != 0.0f) d += s.weight_decay * param;
  if (s.momentum != 0.0f) {
    buf = s.first ? d : buf * s.momentum + s.one_minus_dampening * d;
    d = s.nesterov ? d + s.momentum * buf : buf;
  }
  param += s.neg_lr * d;
}

}  // namespace gpuops::math
