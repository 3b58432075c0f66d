#pragma once
// Torch-free launcher of the fused Adam/AdamW step with block-wise 8-bit moments (math/quant8_math.h).
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "amp_kernels.h"
#include "math/adam_math.h"
#include "math/quant8_math.h"

namespace gpuops::kernels {

/// lists: params (float32, float16 or bfloat16, as `dtype`), grads (same dtype), masters (float32; the params
/// again when float32), exp_avg codes (uint8), exp_avg scales (float32, one per 256 elements), exp_avg_sq codes,
/// exp_avg_sq scales, steps (float32 counters). books: on the device, the signed code book, then the
/// unsigned one. One CUDA block per 256-element state
/// block at a time; the scales advance with the codes. No host sync; CUDA-graph capturable.
void launch_adam8_step(const std::vector<void*> (&lists)[8], const std::vector<int64_t>& numel, GradDtype dtype,
                       const math::AdamHyper& hyper, const StepScalars& scalars, const math::CodeBook* books,
                       cudaStream_t stream);

}  // namespace gpuops::kernels
