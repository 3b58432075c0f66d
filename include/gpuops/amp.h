#pragma once
// Mixed-precision building blocks: the unscale + non-finite check and the device-side scale update.
// Both run without a host sync: the flag, the scale and the trackers are tensors on the gradients' device.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace gpuops::amp {

/// Dynamic loss-scale settings (hysteresis = 1, min_scale = 0, max_scale = inf: torch's GradScaler).
struct ScaleUpdateOptions {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t hysteresis = 1;
  double min_scale = 0.0;
  double max_scale = 0.0;  ///< 0: no maximum
};

/// Multiplies every gradient in place by inv_scale and sets found_inf to 1 if any element was inf or
/// nan (found_inf is never cleared here). Gradients: dense, contiguous float32/float16/bfloat16 tensors
/// on found_inf's device; found_inf and inv_scale: one-element float32 tensors. One launch per dtype on
/// CUDA (multi-tensor), a parallel loop on the CPU; the element math is shared (kernels/math/amp_math.h).
void unscale_and_check_(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale);

/// Pass 1 of the AMP step: reads every gradient once, sets found_inf to 1 if any element is inf or nan
/// and returns the L2 norm of the gradients multiplied by inv_scale (a float32[1] tensor on their device,
/// no host sync). Deterministic: per-chunk partial sums added in a fixed order. Same arguments as
/// unscale_and_check_, which is the pass it replaces when the optimizer applies the factor itself.
at::Tensor unscaled_grad_norm_(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf);

/// Updates scale (float32[1]), growth_tracker (int32[1]) and hysteresis_left (int32[1]) in place from
/// found_inf (float32[1]), on their device, without reading anything back to the host.
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_left,
                   const at::Tensor& found_inf, const ScaleUpdateOptions& options);

}  // namespace gpuops::amp
