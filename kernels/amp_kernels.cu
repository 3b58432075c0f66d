// Mixed-precision kernels: multi-tensor unscale with the non-finite check, and the scale update.
#include "amp_kernels.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gpuops/cuda_check.h"

namespace gpuops::kernels {
namespace {

// One launch handles up to kMaxTensors tensors split into chunks of kChunk elements, one block per chunk
// (the table travels as a kernel argument, well under the 4 KiB limit).
constexpr int kMaxTensors = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 1 << 16;
constexpr int kThreads = 256;

struct TensorTable {
  void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char tensor_of_block[kMaxBlocks];
  int32_t chunk_of_block[kMaxBlocks];
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void unscale_kernel(TensorTable table, const float* inv_scale_ptr, float* found_inf) {
  const int tensor = table.tensor_of_block[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.chunk_of_block[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, table.numel[tensor]);
  T* data = static_cast<T*>(table.data[tensor]);
  const float inv_scale = *inv_scale_ptr;
  bool local_inf = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    data[i] = from_float<T>(math::unscale_element(to_float(data[i]), inv_scale, local_inf));
  }
  if (local_inf) *found_inf = 1.0f;  // every writer writes the same value: no race on the result
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_left,
                                    const float* found_inf, math::ScaleUpdateParams params) {
  math::update_scale(*scale, *growth_tracker, *hysteresis_left, *found_inf != 0.0f, params);
}

template <typename T>
void unscale_all(const std::vector<void*>& data, const std::vector<int64_t>& numel, const float* inv_scale,
                 float* found_inf, cudaStream_t stream) {
  TensorTable table{};
  int tensors = 0, blocks = 0;
  auto flush = [&] {
    if (blocks > 0) {
      unscale_kernel<T><<<blocks, kThreads, 0, stream>>>(table, inv_scale, found_inf);
      GPUOPS_CUDA_CHECK(cudaGetLastError());
    }
    tensors = 0;
    blocks = 0;
  };
  for (size_t t = 0; t < data.size(); ++t) {
    if (numel[t] == 0) continue;
    if (tensors == kMaxTensors) flush();
    table.data[tensors] = data[t];
    table.numel[tensors] = numel[t];
    const int64_t chunks = (numel[t] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (blocks == kMaxBlocks) {
        // The tensor continues in the next launch: it becomes entry 0 of a fresh table.
        flush();
        table.data[0] = data[t];
        table.numel[0] = numel[t];
      }
      table.tensor_of_block[blocks] = static_cast<unsigned char>(tensors);
      table.chunk_of_block[blocks] = static_cast<int32_t>(c);
      ++blocks;
    }
    ++tensors;
  }
  flush();
}

}  // namespace

void launch_unscale_and_check(const std::vector<void*>& data, const std::vector<int64_t>& numel, GradDtype dtype,
                              const float* inv_scale, float* found_inf, cudaStream_t stream) {
  switch (dtype) {
    case GradDtype::Float32: return unscale_all<float>(data, numel, inv_scale, found_inf, stream);
    case GradDtype::Float16: return unscale_all<__half>(data, numel, inv_scale, found_inf, stream);
    case GradDtype::BFloat16: return unscale_all<__nv_bfloat16>(data, numel, inv_scale, found_inf, stream);
  }
}

void launch_update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_left, const float* found_inf,
                         const math::ScaleUpdateParams& params, cudaStream_t stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, hysteresis_left, found_inf, params);
  GPUOPS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gpuops::kernels
