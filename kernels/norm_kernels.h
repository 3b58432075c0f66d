#pragma once
// Torch-free launcher of pass 1 of the AMP step: the non-finite check and the squared L2 norm of the
// unscaled gradients, read once.
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "amp_kernels.h"

namespace gpuops::kernels {

/// Number of double partial sums launch_grad_sumsq needs in its workspace for these sizes.
int64_t grad_sumsq_partials(const std::vector<int64_t>& numel);

/// *sumsq = sum over all elements of (grad * *inv_scale)^2, deterministic (per-chunk partials in
/// `partials`, summed in a fixed order by one block, in double as the CPU loop's blocks are); *found_inf = 1
/// if any element is inf or nan.
void launch_grad_sumsq(const std::vector<void*>& data, const std::vector<int64_t>& numel, GradDtype dtype,
                       const float* inv_scale, double* partials, float* sumsq, float* found_inf, cudaStream_t stream);

}  // namespace gpuops::kernels
