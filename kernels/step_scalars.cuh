#pragma once
// Device reads of StepScalars (amp_kernels.h), shared by the optimizer kernels.
#include "amp_kernels.h"

namespace gpuops::kernels {

/// True when the overflow flag says this step must change nothing.
__device__ __forceinline__ bool step_skipped(const StepScalars& in) {
  return in.found_inf != nullptr && *in.found_inf != 0.0f;
}

/// What the gradients are multiplied by: 1 / grad_scale, or 1.
__device__ __forceinline__ float grad_factor(const StepScalars& in) {
  return in.grad_scale != nullptr ? 1.0f / *in.grad_scale : 1.0f;
}

/// The hyper-parameters with the device learning rate, when one is given.
template <typename Hyper>
__device__ __forceinline__ Hyper with_device_lr(Hyper hyper, const StepScalars& in) {
  if (in.lr != nullptr) hyper.lr = *in.lr;
  return hyper;
}

}  // namespace gpuops::kernels
