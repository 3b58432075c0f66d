// Torch-free device queries over the CUDA runtime.
#include "cuda_device.h"

#include <cuda_runtime_api.h>

#include "gpuops/cuda_check.h"

namespace gpuops::kernels {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky error, report none
    return 0;
  }
  return count;
}

CudaDeviceProps cuda_device_props(int index) {
  cudaDeviceProp prop{};
  GPUOPS_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  int previous = 0;
  GPUOPS_CUDA_CHECK(cudaGetDevice(&previous));
  GPUOPS_CUDA_CHECK(cudaSetDevice(index));
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
  GPUOPS_CUDA_CHECK(cudaSetDevice(previous));
  GPUOPS_CUDA_CHECK(status);
  return {prop.name, static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes),
          prop.multiProcessorCount, prop.major, prop.minor};
}

}  // namespace gpuops::kernels
