// Fused Adam/AdamW: one read of each gradient, one read-modify-write of the parameter and states.
#include "adam_kernels.h"


#include "gpuops/cuda_check.h"
#include "half_convert.cuh"
#include "multi_tensor.cuh"
#include "step_counters.cuh"
#include "step_scalars.cuh"

namespace gpuops::kernels {
namespace {

enum : int { kParam, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kStep };

__global__ void adam_kernel(TensorTable<6> table, math::AdamHyper hyper, StepScalars in) {
  if (step_skipped(in)) return;
  int64_t begin = 0, end = 0;
  const int tensor = chunk_range(table, begin, end);
  const float step = *static_cast<const float*>(table.data[kStep][tensor]) + 1.0f;
  const math::AdamStep s = math::make_adam_step(with_device_lr(hyper, in), step, grad_factor(in));
  float* param = static_cast<float*>(table.data[kParam][tensor]);
  const float* grad = static_cast<const float*>(table.data[kGrad][tensor]);
  float* exp_avg = static_cast<float*>(table.data[kExpAvg][tensor]);
  float* exp_avg_sq = static_cast<float*>(table.data[kExpAvgSq][tensor]);
  float* max_exp_avg_sq = static_cast<float*>(table.data[kMaxExpAvgSq][tensor]);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    if (hyper.amsgrad) {
      float vmax = max_exp_avg_sq[i];
      math::adam_update_amsgrad(p, grad[i], m, v, vmax, s);
      max_exp_avg_sq[i] = vmax;
    } else {
      math::adam_update(p, grad[i], m, v, s);
    }
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

enum : int { kParam16, kGrad16, kMaster, kExpAvgM, kExpAvgSqM, kMaxExpAvgSqM, kStepM };

template <typename T>
__global__ void adam_master_kernel(TensorTable<7> table, math::AdamHyper hyper, StepScalars in) {
  if (step_skipped(in)) return;
  int64_t begin = 0, end = 0;
  const int tensor = chunk_range(table, begin, end);
  const float step = *static_cast<const float*>(table.data[kStepM][tensor]) + 1.0f;
  const math::AdamStep s = math::make_adam_step(with_device_lr(hyper, in), step, grad_factor(in));
  T* param = static_cast<T*>(table.data[kParam16][tensor]);
  const T* grad = static_cast<const T*>(table.data[kGrad16][tensor]);
  float* master = static_cast<float*>(table.data[kMaster][tensor]);
  float* exp_avg = static_cast<float*>(table.data[kExpAvgM][tensor]);
  float* exp_avg_sq = static_cast<float*>(table.data[kExpAvgSqM][tensor]);
  float* max_exp_avg_sq = static_cast<float*>(table.data[kMaxExpAvgSqM][tensor]);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    const float g = half_to_float(grad[i]);
    if (hyper.amsgrad) {
      float vmax = max_exp_avg_sq[i];
      math::adam_update_amsgrad(p, g, m, v, vmax, s);
      max_exp_avg_sq[i] = vmax;
    } else {
      math::adam_update(p, g, m, v, s);
    }
    master[i] = p;
    store_rounded(param + i, p);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace

void launch_adam_master_step(const std::vector<void*> (&lists)[7], const std::vector<int64_t>& numel, GradDtype dtype,
                             const math::AdamHyper& hyper, const StepScalars& scalars, cudaStream_t stream) {
  for_each_table<7>(lists, numel, [&](const TensorTable<7>& table, int blocks) {
    if (dtype == GradDtype::BFloat16) {
      adam_master_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(table, hyper, scalars);
    } else {
      adam_master_kernel<__half><<<blocks, kThreads, 0, stream>>>(table, hyper, scalars);
    }
    GPUOPS_CUDA_CHECK(cudaGetLastError());
  });
  advance_step_counters(lists[kStepM], scalars.found_inf, stream);
}

void launch_adam_step(const std::vector<void*> (&lists)[6], const std::vector<int64_t>& numel,
                      const math::AdamHyper& hyper, const StepScalars& scalars, cudaStream_t stream) {
  for_each_table<6>(lists, numel, [&](const TensorTable<6>& table, int blocks) {
    adam_kernel<<<blocks, kThreads, 0, stream>>>(table, hyper, scalars);
    GPUOPS_CUDA_CHECK(cudaGetLastError());
  });
  advance_step_counters(lists[kStep], scalars.found_inf, stream);
}

}  // namespace gpuops::kernels
