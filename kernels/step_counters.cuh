#pragma once
// Per-tensor float32 step counters (torch's optimizer-state layout), advanced on the device after an
// update launch, and only when the step was applied.
#include <vector>

#include "multi_tensor.cuh"

namespace gpuops::kernels {

/// One block per counter: counters of a tensor split over several update blocks are read by all of them,
/// so they advance in a launch of their own.
void advance_step_counters(const std::vector<void*>& steps, const float* found_inf, cudaStream_t stream);

}  // namespace gpuops::kernels
