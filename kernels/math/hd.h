#pragma once
// GPUOPS_HD marks element math shared by the CUDA kernels and the CPU loops: the CPU tests
// then check the very arithmetic the GPU runs.
#if defined(__CUDACC__)
#define GPUOPS_HD __host__ __device__ __forceinline__
#else
#define GPUOPS_HD inline
#endif
