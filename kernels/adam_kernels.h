#pragma once
// Torch-free launchers of the fused Adam/AdamW step: float32 parameters, or 16-bit ones with an fp32 master copy.
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "amp_kernels.h"
#include "math/adam_math.h"

namespace gpuops::kernels {

/// One fused step over many tensors. lists: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (the
/// exp_avg_sqs again without amsgrad), steps (float32 step counters, one per tensor). The gradient is
/// divided by *scalars.grad_scale when given; nothing is written when *scalars.found_inf != 0, and each
/// step counter advances only on an applied step; *scalars.lr, when given, replaces hyper.lr. No host
/// sync; CUDA-graph capturable.
void launch_adam_step(const std::vector<void*> (&lists)[6], const std::vector<int64_t>& numel,
                      const math::AdamHyper& hyper, const StepScalars& scalars, cudaStream_t stream);

/// The same step on an fp32 master copy of 16-bit parameters. lists: params (float16 or bfloat16, as
/// `dtype`), grads (same dtype), master_params (float32), exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps.
/// The update runs in float32 on the master, which is then rounded (to nearest even) into the parameter.
void launch_adam_master_step(const std::vector<void*> (&lists)[7], const std::vector<int64_t>& numel, GradDtype dtype,
                             const math::AdamHyper& hyper, const StepScalars& scalars, cudaStream_t stream);

}  // namespace gpuops::kernels
