#pragma once
// Torch-free launchers of the mixed-precision kernels.
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "math/amp_math.h"

namespace gpuops::kernels {

enum class GradDtype { Float32, Float16, BFloat16 };

/// What an optimizer step reads on the device (null: not given): the divisor of the gradients (a loss
/// scale), the overflow flag (non-zero: change nothing), and the learning rate (replaces the host lr, so
/// a step captured in a CUDA graph follows an LR schedule that writes the tensor).
struct StepScalars {
  const float* grad_scale = nullptr;
  const float* found_inf = nullptr;
  const float* lr = nullptr;
};

/// Multiplies every element of the tensors by *inv_scale in place and sets *found_inf to 1 when any
/// element was inf or nan. One launch covers many tensors (pointer tables); all tensors share
/// `dtype` and live on the current device. Deterministic: found_inf is only ever set to 1.
void launch_unscale_and_check(const std::vector<void*>& data, const std::vector<int64_t>& numel, GradDtype dtype,
                              const float* inv_scale, float* found_inf, cudaStream_t stream);

/// The loss-scale update of math::update_scale, on the device (one thread: no host sync).
void launch_update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_left, const float* found_inf,
                         const math::ScaleUpdateParams& params, cudaStream_t stream);

}  // namespace gpuops::kernels
