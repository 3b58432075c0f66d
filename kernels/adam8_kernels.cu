// Fused Adam/AdamW with 8-bit moments: per 256-element block, decode, update in float32, re-encode with the
// block's new scale (its largest magnitude, a block-wide maximum in shared memory), in one pass.
#include "adam8_kernels.h"

#include <type_traits>

#include "gpuops/cuda_check.h"
#include "half_convert.cuh"
#include "math/quant8_math.h"
#include "multi_tensor.cuh"
#include "step_counters.cuh"
#include "step_scalars.cuh"

namespace gpuops::kernels {
namespace {

enum : int { kParam, kGrad, kMaster, kMCodes, kMScales, kVCodes, kVScales, kStep };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return half_to_float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return half_to_float(v); }

/// The block-wide NaN-propagating maximum of every thread's `mine` (blockDim.x == kQuantBlock).
__device__ __forceinline__ float block_max(float mine, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) mine = math::magnitude_max(mine, __shfl_xor_sync(~0u, mine, offset));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = mine;
  __syncthreads();
  float all = scratch[0];
  for (int w = 1; w < math::kQuantBlock / 32; ++w) all = math::magnitude_max(all, scratch[w]);
  __syncthreads();  // scratch is reused by the next call
  return all;
}

template <typename T>
__global__ void __launch_bounds__(math::kQuantBlock) adam8_kernel(TensorTable<8> table, math::AdamHyper hyper,
                                                                   StepScalars in, const math::CodeBook* books) {
  if (step_skipped(in)) return;
  __shared__ math::CodeBook book[2];  // signed (first moments), unsigned (second)
  static_assert(sizeof(book) % sizeof(uint32_t) == 0, "copied in words");
  const auto* from = reinterpret_cast<const uint32_t*>(books);
  auto* to = reinterpret_cast<uint32_t*>(book);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(book) / sizeof(uint32_t)); i += blockDim.x) to[i] = from[i];
  __shared__ float scratch[math::kQuantBlock / 32];
  __syncthreads();
  int64_t begin = 0, end = 0;
  const int tensor = chunk_range(table, begin, end);
  const float step = *static_cast<const float*>(table.data[kStep][tensor]) + 1.0f;
  const math::AdamStep s = math::make_adam_step(with_device_lr(hyper, in), step, grad_factor(in));
  T* param = static_cast<T*>(table.data[kParam][tensor]);
  const T* grad = static_cast<const T*>(table.data[kGrad][tensor]);
  float* master = static_cast<float*>(table.data[kMaster][tensor]);
  uint8_t* m_codes = static_cast<uint8_t*>(table.data[kMCodes][tensor]);
  float* m_scales = static_cast<float*>(table.data[kMScales][tensor]);
  uint8_t* v_codes = static_cast<uint8_t*>(table.data[kVCodes][tensor]);
  float* v_scales = static_cast<float*>(table.data[kVScales][tensor]);
  for (int64_t base = begin; base < end; base += math::kQuantBlock) {  // chunks start on a block boundary
    const int64_t i = base + threadIdx.x, b = base / math::kQuantBlock;
    const bool mine = i < end;
    float m = 0.0f, v = 0.0f;
    if (mine) {
      m = math::decode(book[0].value, m_codes[i], m_scales[b]);
      v = math::decode(book[1].value, v_codes[i], v_scales[b]);
      float p = master[i];
      math::adam_update(p, to_float(grad[i]), m, v, s);
      master[i] = p;
      if constexpr (!std::is_same_v<T, float>) store_rounded(param + i, p);  // (float: the master is the parameter)
    }
    const float m_max = block_max(fabsf(m), scratch), v_max = block_max(fabsf(v), scratch);
    if (mine) {
      m_codes[i] = math::encode(book[0], m, m_max);
      v_codes[i] = math::encode(book[1], v, v_max);
    }
    if (threadIdx.x == 0) {
      m_scales[b] = m_max;
      v_scales[b] = v_max;
    }
  }
}

}  // namespace

void launch_adam8_step(const std::vector<void*> (&lists)[8], const std::vector<int64_t>& numel, GradDtype dtype,
                       const math::AdamHyper& hyper, const StepScalars& scalars, const math::CodeBook* books,
                       cudaStream_t stream) {
  for_each_table<8>(lists, numel, [&](const TensorTable<8>& table, int blocks) {
    if (dtype == GradDtype::BFloat16) {
      adam8_kernel<__nv_bfloat16><<<blocks, math::kQuantBlock, 0, stream>>>(table, hyper, scalars, books);
    } else if (dtype == GradDtype::Float16) {
      adam8_kernel<__half><<<blocks, math::kQuantBlock, 0, stream>>>(table, hyper, scalars, books);
    } else {
      adam8_kernel<float><<<blocks, math::kQuantBlock, 0, stream>>>(table, hyper, scalars, books);
    }
    GPUOPS_CUDA_CHECK(cudaGetLastError());
  });
  advance_step_counters(lists[kStep], scalars.found_inf, stream);
}

}  // namespace gpuops::kernels
