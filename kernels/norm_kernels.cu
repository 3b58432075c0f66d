// Pass 1 of the AMP step: one read of every gradient gives the overflow flag and the squared norm.
// Two stages (per-chunk partials, then one block) so the norm is the same run to run.
#include "norm_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gpuops/cuda_check.h"
#include "multi_tensor.cuh"

namespace gpuops::kernels {
namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Fixed-shape tree sum over the block: the order never changes, so neither does the result.
__device__ double block_sum(double value) {
  __shared__ double shared[kThreads];
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

template <typename T>
__global__ void sumsq_kernel(TensorTable<1> table, const float* inv_scale_ptr, double* partials,
                             int64_t first_partial, float* found_inf) {
  int64_t begin = 0, end = 0;
  const int tensor = chunk_range(table, begin, end);
  const T* data = static_cast<const T*>(table.data[0][tensor]);
  const float inv_scale = *inv_scale_ptr;
  double sum = 0.0;  // double from the first add: float over a 64 Ki chunk would lose ~1e-6 of the norm
  bool local_inf = false;
  for_each_round(begin, end, packable(table.numel[tensor], data), [&](const Lanes& lanes) {
    const Pack<T> values = lanes.load(data);
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {  // lanes past the end are zero: finite, adding nothing
      const float g = to_float(values.v[k]);
      if (!isfinite(g)) local_inf = true;
      const float u = g * inv_scale;
      sum += static_cast<double>(u * u);
    }
  });
  if (local_inf) *found_inf = 1.0f;
  const double total = block_sum(sum);
  if (threadIdx.x == 0) partials[first_partial + blockIdx.x] = total;
}

__global__ void finish_kernel(const double* partials, int64_t count, float* sumsq) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  const double total = block_sum(sum);
  if (threadIdx.x == 0) *sumsq = static_cast<float>(total);
}

template <typename T>
void sumsq_all(const std::vector<void*>& data, const std::vector<int64_t>& numel, const float* inv_scale,
               double* partials, float* sumsq, float* found_inf, cudaStream_t stream) {
  const std::vector<void*> lists[1] = {data};
  int64_t used = 0;
  for_each_table<1>(lists, numel, [&](const TensorTable<1>& table, int blocks) {
    sumsq_kernel<T><<<blocks, kThreads, 0, stream>>>(table, inv_scale, partials, used, found_inf);
    GPUOPS_CUDA_CHECK(cudaGetLastError());
    used += blocks;
  });
  finish_kernel<<<1, kThreads, 0, stream>>>(partials, used, sumsq);
  GPUOPS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int64_t grad_sumsq_partials(const std::vector<int64_t>& numel) {
  int64_t chunks = 0;
  for (int64_t n : numel) chunks += (n + kChunk - 1) / kChunk;
  return chunks > 0 ? chunks : 1;
}

void launch_grad_sumsq(const std::vector<void*>& data, const std::vector<int64_t>& numel, GradDtype dtype,
                       const float* inv_scale, double* partials, float* sumsq, float* found_inf,
                       cudaStream_t stream) {
  switch (dtype) {
    case GradDtype::Float32: return sumsq_all<float>(data, numel, inv_scale, partials, sumsq, found_inf, stream);
    case GradDtype::Float16: return sumsq_all<__half>(data, numel, inv_scale, partials, sumsq, found_inf, stream);
    case GradDtype::BFloat16:
      return sumsq_all<__nv_bfloat16>(data, numel, inv_scale, partials, sumsq, found_inf, stream);
  }
}

}  // namespace gpuops::kernels
