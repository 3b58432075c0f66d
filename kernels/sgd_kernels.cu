// Fused SGD: one read of each gradient, one read-modify-write of the parameter and its momentum buffer.
#include "sgd_kernels.h"

#include "gpuops/cuda_check.h"
#include "half_convert.cuh"
#include "multi_tensor.cuh"
#include "step_counters.cuh"
#include "step_scalars.cuh"

namespace gpuops::kernels {
namespace {

__global__ void sgd_kernel(TensorTable<4> table, math::SgdHyper hyper, StepScalars in) {
  if (step_skipped(in)) return;
  int64_t begin = 0, end = 0;
  const int tensor = chunk_range(table, begin, end);
  const bool first = *static_cast<const float*>(table.data[3][tensor]) == 0.0f;
  const math::SgdStep s = math::make_sgd_step(with_device_lr(hyper, in), first, grad_factor(in));
  float* param = static_cast<float*>(table.data[0][tensor]);
  const float* grad = static_cast<const float*>(table.data[1][tensor]);
  float* buf = static_cast<float*>(table.data[2][tensor]);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float p = param[i], b = s.momentum != 0.0f ? buf[i] : 0.0f;
    math::sgd_update(p, grad[i], b, s);
    param[i] = p;
    if (s.momentum != 0.0f) buf[i] = b;
  }
}

template <typename T>
__global__ void sgd_master_kernel(TensorTable<5> table, math::SgdHyper hyper, StepScalars in) {
  if (step_skipped(in)) return;
  int64_t begin = 0, end = 0;
  const int tensor = chunk_range(table, begin, end);
  const bool first = *static_cast<const float*>(table.data[4][tensor]) == 0.0f;
  const math::SgdStep s = math::make_sgd_step(with_device_lr(hyper, in), first, grad_factor(in));
  T* param = static_cast<T*>(table.data[0][tensor]);
  const T* grad = static_cast<const T*>(table.data[1][tensor]);
  float* master = static_cast<float*>(table.data[2][tensor]);
  float* buf = static_cast<float*>(table.data[3][tensor]);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float p = master[i], b = s.momentum != 0.0f ? buf[i] : 0.0f;
    math::sgd_update(p, half_to_float(grad[i]), b, s);
    master[i] = p;
    store_rounded(param + i, p);
    if (s.momentum != 0.0f) buf[i] = b;
  }
}

}  // namespace

void launch_sgd_master_step(const std::vector<void*> (&lists)[5], const std::vector<int64_t>& numel, GradDtype dtype,
                            const math::SgdHyper& hyper, const StepScalars& scalars, cudaStream_t stream) {
  for_each_table<5>(lists, numel, [&](const TensorTable<5>& table, int blocks) {
    if (dtype == GradDtype::BFloat16) {
      sgd_master_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(table, hyper, scalars);
    } else {
      sgd_master_kernel<__half><<<blocks, kThreads, 0, stream>>>(table, hyper, scalars);
    }
    GPUOPS_CUDA_CHECK(cudaGetLastError());
  });
  advance_step_counters(lists[4], scalars.found_inf, stream);
}

void launch_sgd_step(const std::vector<void*> (&lists)[4], const std::vector<int64_t>& numel,
                     const math::SgdHyper& hyper, const StepScalars& scalars, cudaStream_t stream) {
  for_each_table<4>(lists, numel, [&](const TensorTable<4>& table, int blocks) {
    sgd_kernel<<<blocks, kThreads, 0, stream>>>(table, hyper, scalars);
    GPUOPS_CUDA_CHECK(cudaGetLastError());
  });
  advance_step_counters(lists[3], scalars.found_inf, stream);
}

}  // namespace gpuops::kernels
