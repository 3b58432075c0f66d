#pragma once
// AdamStepOptions -> the element math's hyper-parameters, for the fused Adam steps (32-bit and 8-bit states).
#include "gpuops/fused_adam.h"
#include "math/adam_math.h"

namespace gpuops::optim::detail {

inline math::AdamHyper to_hyper(const AdamStepOptions& o) {
  return {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.decoupled, o.amsgrad, o.maximize};
}

/// The CPU steps' hyper-parameters: a CPU lr tensor is read here (a plain load).
inline math::AdamHyper to_cpu_hyper(const AdamStepOptions& o) {
  math::AdamHyper hyper = to_hyper(o);
  if (o.lr_tensor) hyper.lr = *o.lr_tensor->data_ptr<float>();
  return hyper;
}

}  // namespace gpuops::optim::detail
