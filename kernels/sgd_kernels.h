#pragma once
// Torch-free launcher of the fused SGD step (float32 parameters).
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "amp_kernels.h"
#include "math/sgd_math.h"

namespace gpuops::kernels {

/// lists: params, grads, momentum buffers (the params again without momentum), steps (float32 counters:
/// 0 means the buffer starts from this step's gradient). scalars as for Adam.
void launch_sgd_step(const std::vector<void*> (&lists)[4], const std::vector<int64_t>& numel,
                     const math::SgdHyper& hyper, const StepScalars& scalars, cudaStream_t stream);

/// The same step on an fp32 master copy of 16-bit parameters. lists: params (float16 or bfloat16, as
/// `dtype`), grads (same dtype), master_params (float32), momentum buffers (float32; the masters again
/// without momentum), steps. The master is rounded (to nearest even) into the parameter.
void launch_sgd_master_step(const std::vector<void*> (&lists)[5], const std::vector<int64_t>& numel, GradDtype dtype,
                            const math::SgdHyper& hyper, const StepScalars& scalars, cudaStream_t stream);

}  // namespace gpuops::kernels
