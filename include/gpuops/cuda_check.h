#pragma once
// GPUOPS_CUDA_CHECK: turns a failed CUDA runtime call into a std::runtime_error that carries the
// call, the CUDA error name and text, and the file and line. Torch-free so kernels/ can use it.

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace gpuops::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(status) + " (" +
                           cudaGetErrorString(status) + ") in `" + call + "` at " + file + ":" +
                           std::to_string(line));
}

}  // namespace gpuops::detail

#define GPUOPS_CUDA_CHECK(call)                                                           \
  do {                                                                                    \
    const cudaError_t gpuops_status_ = (call);                                            \
    if (gpuops_status_ != cudaSuccess)                                                    \
      ::gpuops::detail::throw_cuda_error(gpuops_status_, #call, __FILE__, __LINE__);      \
  } while (0)
