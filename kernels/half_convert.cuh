#pragma once
// float16 / bfloat16 <-> float32 on the device, for the master-copy optimizer kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "multi_tensor.cuh"

namespace gpuops::kernels {

__device__ __forceinline__ float half_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float half_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
/// Rounds to nearest even, as torch's .to() does.
__device__ __forceinline__ void store_rounded(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_rounded(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

/// A round's float32 values rounded into T, each as store_rounded does.
template <typename T>
__device__ __forceinline__ Pack<T> rounded(const Pack<float>& values) {
  Pack<T> r;
#pragma unroll
  for (int k = 0; k < kIlp; ++k) store_rounded(&r.v[k], values.v[k]);
  return r;
}

}  // namespace gpuops::kernels
