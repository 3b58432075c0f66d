#pragma once
// Element math of mixed precision: unscaling a gradient and the dynamic loss-scale update.
#include <cmath>
#include <cstdint>

#include "hd.h"

namespace gpuops::math {

/// Dynamic loss-scale settings. hysteresis = 1 and min_scale = 0, max_scale = inf give torch's GradScaler.
struct ScaleUpdateParams {
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
  int32_t hysteresis = 1;  ///< overflowing steps tolerated before backing off (DeepSpeed's meaning)
  float min_scale = 0.0f;
  float max_scale = INFINITY;
};

GPUOPS_HD bool is_finite(float v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

/// One unscaled gradient element; `found_inf` is set when the input is inf or nan (as torch checks it).
GPUOPS_HD float unscale_element(float grad, float inv_scale, bool& found_inf) {
  if (!is_finite(grad)) found_inf = true;
  return inv_scale == 1.0f ? grad : grad * inv_scale;
}

/// The scale update after a step. An overflow resets the growth tracker and, once the hysteresis budget
/// (`hysteresis` overflows) is spent, multiplies the scale by backoff_factor (not below min_scale);
/// growth_interval clean steps in a row multiply it by growth_factor (not above max_scale, and only if
/// the result is finite) and restore the budget. As DeepSpeed's default (consecutive_hysteresis=False):
/// overflows alternating with clean steps still spend it, so the scale does back off.
GPUOPS_HD void update_scale(float& scale, int32_t& growth_tracker, int32_t& hysteresis_left, bool found_inf,
                            const ScaleUpdateParams& p) {
  if (found_inf) {
    growth_tracker = 0;
    if (hysteresis_left > 1) {
      --hysteresis_left;
    } else {
      const float reduced = scale * p.backoff_factor;
      scale = reduced < p.min_scale ? p.min_scale : reduced;
    }
    return;
  }
  const int32_t successful = growth_tracker + 1;
  if (successful == p.growth_interval) {
    const float grown = scale * p.growth_factor;
    if (is_finite(grown)) scale = grown > p.max_scale ? p.max_scale : grown;
    growth_tracker = 0;
    hysteresis_left = p.hysteresis;  // restored at growth only, as DeepSpeed's default (not consecutive)
  } else {
    growth_tracker = successful;
  }
}

}  // namespace gpuops::math
