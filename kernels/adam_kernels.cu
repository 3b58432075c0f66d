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
  const bool packed = packable(table.numel[tensor], param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq);
  for_each_round(begin, end, packed, [&](const Lanes& lanes) {
    Pack<float> p = lanes.load(param), g = lanes.load(grad), m = lanes.load(exp_avg), v = lanes.load(exp_avg_sq);
    if (hyper.amsgrad) {
      Pack<float> vmax = lanes.load(max_exp_avg_sq);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) math::adam_update_amsgrad(p.v[k], g.v[k], m.v[k], v.v[k], vmax.v[k], s);
      lanes.store(max_exp_avg_sq, vmax);
    } else {
#pragma unroll
      for (int k = 0; k < kIlp; ++k) math::adam_update(p.v[k], g.v[k], m.v[k], v.v[k], s);
    }
    lanes.store(param, p);
    lanes.store(exp_avg, m);
    lanes.store(exp_avg_sq, v);
  });
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
  const bool packed = packable(table.numel[tensor], param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq);
  for_each_round(begin, end, packed, [&](const Lanes& lanes) {
    Pack<float> p = lanes.load(master), m = lanes.load(exp_avg), v = lanes.load(exp_avg_sq);
    const Pack<T> g = lanes.load(grad);
    if (hyper.amsgrad) {
      Pack<float> vmax = lanes.load(max_exp_avg_sq);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        math::adam_update_amsgrad(p.v[k], half_to_float(g.v[k]), m.v[k], v.v[k], vmax.v[k], s);
      }
      lanes.store(max_exp_avg_sq, vmax);
    } else {
#pragma unroll
      for (int k = 0; k < kIlp; ++k) math::adam_update(p.v[k], half_to_float(g.v[k]), m.v[k], v.v[k], s);
    }
    lanes.store(master, p);
    lanes.store(param, rounded<T>(p));
    lanes.store(exp_avg, m);
    lanes.store(exp_avg_sq, v);
  });
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
