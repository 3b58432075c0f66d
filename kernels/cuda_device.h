#pragma once
// Torch-free queries of the CUDA runtime (compiled by nvcc with the kernels).
#include <cstdint>
#include <string>

namespace gpuops::kernels {

struct CudaDeviceProps {
  std::string name;
  int64_t total_memory_bytes = 0;
  int64_t free_memory_bytes = 0;
  int multiprocessors = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

/// Number of CUDA devices this process sees (after CUDA_VISIBLE_DEVICES); 0 when there is no
/// device or no driver, never an error.
int cuda_device_count();

/// Properties and current free memory of one visible device; throws std::runtime_error on failure.
CudaDeviceProps cuda_device_props(int index);

}  // namespace gpuops::kernels
