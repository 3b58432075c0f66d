// adam_step_: argument checks, then the CPU loop or the CUDA multi-tensor launcher (same element math).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "gpuops/fused_adam.h"
#include "math/adam_math.h"
#include "optim_checks.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam_kernels.h"
#endif

namespace gpuops::optim {
namespace {

void check_hyper(const AdamOptions& o) {
  TORCH_CHECK_VALUE(o.lr >= 0.0, "adam_step_: lr must be >= 0, got ", o.lr);
  TORCH_CHECK_VALUE(o.beta1 >= 0.0 && o.beta1 < 1.0, "adam_step_: betas[0] must be in [0, 1), got ", o.beta1);
  TORCH_CHECK_VALUE(o.beta2 >= 0.0 && o.beta2 < 1.0, "adam_step_: betas[1] must be in [0, 1), got ", o.beta2);
  TORCH_CHECK_VALUE(o.eps >= 0.0, "adam_step_: eps must be >= 0, got ", o.eps);
  TORCH_CHECK_VALUE(o.weight_decay >= 0.0, "adam_step_: weight_decay must be >= 0, got ", o.weight_decay);
}

void check_all(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamOptions& options,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_hyper(options);
  if (options.amsgrad) {
    detail::check_step_lists("adam_step_", params,
                             {{"grads", grads}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs},
                              {"max_exp_avg_sqs", max_exp_avg_sqs}},
                             steps, grad_scale, found_inf);
  } else {
    detail::check_step_lists("adam_step_", params,
                             {{"grads", grads}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, steps,
                             grad_scale, found_inf);
  }
}

// The CPU element loops, compiled for AVX-512, AVX2 and the baseline; the loader picks one at startup.
__attribute__((target_clones("avx512f", "avx2", "default"))) void adam_range(
    float* __restrict param, const float* __restrict grad, float* __restrict m, float* __restrict v, int64_t n,
    const math::AdamStep& step) {
  using math::Float8, math::load8, math::store8;
  const math::AdamStep s = step;  // a local copy: stores to the arrays cannot change it
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Float8 exp_avg = load8(m + i), exp_avg_sq = load8(v + i);
    const Float8 decayed = math::adam_moments(load8(param + i), load8(grad + i), exp_avg, exp_avg_sq, s);
    store8(param + i, math::adam_apply(decayed, exp_avg, exp_avg_sq, s));
    store8(m + i, exp_avg);
    store8(v + i, exp_avg_sq);
  }
  for (; i < n; ++i) math::adam_update(param[i], grad[i], m[i], v[i], s);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void adam_amsgrad_range(
    float* __restrict param, const float* __restrict grad, float* __restrict m, float* __restrict v,
    float* __restrict vmax, int64_t n, const math::AdamStep& step) {
  const math::AdamStep s = step;
  for (int64_t i = 0; i < n; ++i) math::adam_update_amsgrad(param[i], grad[i], m[i], v[i], vmax[i], s);
}

math::AdamHyper to_hyper(const AdamOptions& o) {
  return {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.decoupled, o.amsgrad, o.maximize};
}

void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamOptions& options,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  // CPU tensors: these reads are plain loads, not device-to-host copies.
  if (found_inf && *found_inf->data_ptr<float>() != 0.0f) return;
  const float factor = grad_scale ? 1.0f / *grad_scale->data_ptr<float>() : 1.0f;
  const math::AdamHyper hyper = to_hyper(options);
  for (size_t t = 0; t < params.size(); ++t) {
    float* step = steps[t].data_ptr<float>();
    const math::AdamStep s = math::make_adam_step(hyper, *step + 1.0f, factor);
    float* param = params[t].data_ptr<float>();
    const float* grad = grads[t].data_ptr<float>();
    float* m = exp_avgs[t].data_ptr<float>();
    float* v = exp_avg_sqs[t].data_ptr<float>();
    float* vmax = options.amsgrad ? max_exp_avg_sqs[t].data_ptr<float>() : nullptr;
    at::parallel_for(0, params[t].numel(), 1 << 14, [&](int64_t begin, int64_t end) {
      if (vmax != nullptr) {
        adam_amsgrad_range(param + begin, grad + begin, m + begin, v + begin, vmax + begin, end - begin, s);
      } else {
        adam_range(param + begin, grad + begin, m + begin, v + begin, end - begin, s);
      }
    });
    *step += 1.0f;
  }
}

#ifdef GPUOPS_WITH_CUDA
void adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamOptions& options,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<void*> lists[6];
  std::vector<int64_t> numel;
  for (size_t t = 0; t < params.size(); ++t) {
    lists[0].push_back(params[t].data_ptr());
    lists[1].push_back(grads[t].data_ptr());
    lists[2].push_back(exp_avgs[t].data_ptr());
    lists[3].push_back(exp_avg_sqs[t].data_ptr());
    lists[4].push_back(options.amsgrad ? max_exp_avg_sqs[t].data_ptr() : exp_avg_sqs[t].data_ptr());
    lists[5].push_back(steps[t].data_ptr());
    numel.push_back(params[t].numel());
  }
  kernels::launch_adam_step(lists, numel, to_hyper(options), grad_scale ? grad_scale->data_ptr<float>() : nullptr,
                            found_inf ? found_inf->data_ptr<float>() : nullptr, c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamOptions& options,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_all(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options, grad_scale, found_inf);
  if (params.empty()) return;
  const at::Device device = params[0].device();
  if (device.is_cpu()) {
    return adam_cpu(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options, grad_scale, found_inf);
  }
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) {
    return adam_cuda(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options, grad_scale, found_inf);
  }
#endif
  TORCH_CHECK_VALUE(false, "adam_step_: device ", device, " is not supported");
}

}  // namespace gpuops::optim
