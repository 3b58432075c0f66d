#pragma once
// The CPU element loop of the fused Adam step (fused_adam.cpp), shared with the 8-bit step's blocks.
#include <cstdint>

#include "math/adam_math.h"

namespace gpuops::optim::detail {

/// n elements of one Adam/AdamW step without amsgrad, 8 at a time (compiled for AVX-512, AVX2 and the
/// baseline; the loader picks one).
void adam_range(float* __restrict param, const float* __restrict grad, float* __restrict m, float* __restrict v,
                int64_t n, const math::AdamStep& step);

}  // namespace gpuops::optim::detail
