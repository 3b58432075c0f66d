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
  const bool packed = packable(table.numel[tensor], param, grad, buf);
  for_each_round(begin, end, packed, [&](const Lanes& lanes) {
    Pack<float> p = lanes.load(param), b = s.momentum != 0.0f ? lanes.load(buf) : Pack<float>{};
    const Pack<float> g = lanes.load(grad);
#pragma unroll
    for (int k = 0; k < kIlp; ++k) math::sgd_update(p.v[k], g.v[k], b.v[k], s);
    lanes.store(param, p);
    if (s.momentum != 0.0f) lanes.store(buf, b);
  });
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
  const bool packed = packable(table.numel[tensor], param, grad, master, buf);
  for_each_round(begin, end, packed, [&](const Lanes& lanes) {
    Pack<float> p = lanes.load(master), b = s.momentum != 0.0f ? lanes.load(buf) : Pack<float>{};
    const Pack<T> g = lanes.load(grad);
#pragma unroll
    for (int k = 0; k < kIlp; ++k) math::sgd_update(p.v[k], half_to_float(g.v[k]), b.v[k], s);
    lanes.store(master, p);
    lanes.store(param, rounded<T>(p));
    if (s.momentum != 0.0f) lanes.store(buf, b);
  });
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
