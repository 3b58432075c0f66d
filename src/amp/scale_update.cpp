// update_scale_: the dynamic loss-scale update on the state's device.
#include <cmath>
#include <limits>

#include "amp_checks.h"
#include "gpuops/amp.h"
#include "math/amp_math.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "amp_kernels.h"
#endif

namespace gpuops::amp {
namespace {

math::ScaleUpdateParams to_params(const ScaleUpdateOptions& o) {
  // The scale is a float32 tensor: a factor or bound beyond float32 would make it inf (then every step skips).
  constexpr double max_float = std::numeric_limits<float>::max();
  TORCH_CHECK_VALUE(o.growth_factor > 1.0 && o.growth_factor <= max_float,
                    "update_scale_: growth_factor must be a finite float32 number > 1, got ", o.growth_factor);
  TORCH_CHECK_VALUE(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, "backoff_factor must be in (0, 1), got ",
                    o.backoff_factor);
  TORCH_CHECK_VALUE(o.growth_interval >= 1 && o.growth_interval <= std::numeric_limits<int32_t>::max(),
                    "growth_interval must be in [1, 2^31), got ", o.growth_interval);
  TORCH_CHECK_VALUE(o.hysteresis >= 1 && o.hysteresis <= std::numeric_limits<int32_t>::max(),
                    "hysteresis must be >= 1, got ", o.hysteresis);
  TORCH_CHECK_VALUE(o.min_scale >= 0.0 && o.min_scale <= max_float,
                    "update_scale_: min_scale must be a float32 number >= 0, got ", o.min_scale);
  TORCH_CHECK_VALUE(o.max_scale == 0.0 || (o.max_scale >= o.min_scale && o.max_scale <= max_float),
                    "update_scale_: max_scale must be 0 (no maximum) or a float32 number >= min_scale=", o.min_scale,
                    ", got ", o.max_scale);
  math::ScaleUpdateParams p;
  p.growth_factor = static_cast<float>(o.growth_factor);
  p.backoff_factor = static_cast<float>(o.backoff_factor);
  p.growth_interval = static_cast<int32_t>(o.growth_interval);
  p.hysteresis = static_cast<int32_t>(o.hysteresis);
  p.min_scale = static_cast<float>(o.min_scale);
  p.max_scale = o.max_scale == 0.0 ? INFINITY : static_cast<float>(o.max_scale);
  return p;
}

}  // namespace

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_left,
                   const at::Tensor& found_inf, const ScaleUpdateOptions& options) {
  TORCH_CHECK_VALUE(scale.defined(), "update_scale_: scale is undefined");
  const at::Device device = scale.device();
  detail::check_scalar_state(scale, "scale", at::kFloat, device);
  detail::check_scalar_state(growth_tracker, "growth_tracker", at::kInt, device);
  detail::check_scalar_state(hysteresis_left, "hysteresis_left", at::kInt, device);
  detail::check_scalar_state(found_inf, "found_inf", at::kFloat, device);
  const math::ScaleUpdateParams params = to_params(options);
  if (device.is_cpu()) {
    math::update_scale(*scale.data_ptr<float>(), *growth_tracker.data_ptr<int32_t>(),
                       *hysteresis_left.data_ptr<int32_t>(), *found_inf.data_ptr<float>() != 0.0f, params);
    return;
  }
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    kernels::launch_update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                                 hysteresis_left.data_ptr<int32_t>(), found_inf.data_ptr<float>(), params,
                                 c10::cuda::getCurrentCUDAStream());
    return;
  }
#endif
  TORCH_CHECK_VALUE(false, "update_scale_: device ", device, " is not supported");
}

}  // namespace gpuops::amp
