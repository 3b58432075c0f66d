// adam_step_: argument checks, then the CPU loop or the CUDA multi-tensor launcher (same element math).
#include <array>
#include <utility>

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include "../common/cpu_parallel.h"
#include "adam_cpu.h"
#include "adam_hyper.h"
#include "gpuops/fused_adam.h"
#include "math/adam_math.h"
#include "optim_checks.h"
#include "option_checks.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam_kernels.h"
#include "pointer_lists.h"
#endif

namespace gpuops::optim {

namespace detail {

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

}  // namespace detail


void check_adam_options(const AdamStepOptions& o, const std::string& where) {
  using gpuops::detail::check_option;
  check_option(std::isfinite(o.lr) && o.lr >= 0.0, where, "Invalid learning rate", o.lr,
               "lr must be a finite number >= 0");
  check_option(o.beta1 >= 0.0 && o.beta1 < 1.0, where, "Invalid beta parameter at index 0", o.beta1,
               "betas[0] must be in [0, 1)");
  check_option(o.beta2 >= 0.0 && o.beta2 < 1.0, where, "Invalid beta parameter at index 1", o.beta2,
               "betas[1] must be in [0, 1)");
  check_option(std::isfinite(o.eps) && o.eps >= 0.0, where, "Invalid epsilon value", o.eps,
               "eps must be a finite number >= 0");
  check_option(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0, where, "Invalid weight_decay value",
               o.weight_decay, "weight_decay must be a finite number >= 0");
}

namespace {

void check_all(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamStepOptions& options,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_adam_options(options, "adam_step_");
  if (options.amsgrad) {
    detail::check_step_lists("adam_step_", params,
                             {{"grads", grads}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs},
                              {"max_exp_avg_sqs", max_exp_avg_sqs}},
                             steps, grad_scale, found_inf, options.lr_tensor);
  } else {
    detail::check_step_lists("adam_step_", params,
                             {{"grads", grads}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, steps,
                             grad_scale, found_inf, options.lr_tensor);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void adam_amsgrad_range(
    float* __restrict param, const float* __restrict grad, float* __restrict m, float* __restrict v,
    float* __restrict vmax, int64_t n, const math::AdamStep& step) {
  const math::AdamStep s = step;
  for (int64_t i = 0; i < n; ++i) math::adam_update_amsgrad(param[i], grad[i], m[i], v[i], vmax[i], s);
}

using detail::adam_range, detail::to_cpu_hyper, detail::to_hyper;

// The CPU step over every tensor's pieces (common/cpu_parallel.h), with this optimizer's per-step constants.
template <typename Body>
void for_each_applied_piece(at::TensorList tensors, at::TensorList steps, const AdamStepOptions& options,
                            const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                            const Body& body) {
  const auto hyper = to_cpu_hyper(options);
  auto constants = [&](float step, float factor) { return math::make_adam_step(hyper, step + 1.0f, factor); };
  cpu::for_each_applied_piece(tensors, steps, grad_scale, found_inf, constants, body);
}

void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamStepOptions& options,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  for_each_applied_piece(params, steps, options, grad_scale, found_inf,
                         [&](size_t t, int64_t begin, int64_t end, const math::AdamStep& s) {
    float* param = params[t].data_ptr<float>() + begin;
    const float* grad = grads[t].data_ptr<float>() + begin;
    float* m = exp_avgs[t].data_ptr<float>() + begin;
    float* v = exp_avg_sqs[t].data_ptr<float>() + begin;
    if (options.amsgrad) {
      adam_amsgrad_range(param, grad, m, v, max_exp_avg_sqs[t].data_ptr<float>() + begin, end - begin, s);
    } else {
      adam_range(param, grad, m, v, end - begin, s);
    }
  });
}

// 16-bit parameters with an fp32 master copy: the float32 update of the master, rounded into the parameter.
template <typename T>
void adam_master_range(T* param, const T* grad, float* master, float* m, float* v, float* vmax, int64_t n,
                       const math::AdamStep& step) {
  const math::AdamStep s = step;
  for (int64_t i = 0; i < n; ++i) {
    float p = master[i];
    const float g = static_cast<float>(grad[i]);
    if (vmax != nullptr) {
      math::adam_update_amsgrad(p, g, m[i], v[i], vmax[i], s);
    } else {
      math::adam_update(p, g, m[i], v[i], s);
    }
    master[i] = p;
    param[i] = static_cast<T>(p);  // c10::Half / c10::BFloat16 round to nearest even
  }
}

void adam_master_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                     const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  for_each_applied_piece(masters, steps, options, grad_scale, found_inf,
                         [&](size_t t, int64_t begin, int64_t end, const math::AdamStep& s) {
    float* vmax = options.amsgrad ? max_exp_avg_sqs[t].data_ptr<float>() + begin : nullptr;
    AT_DISPATCH_REDUCED_FLOATING_TYPES(params[t].scalar_type(), "adam_step_master_", [&] {
      adam_master_range(params[t].data_ptr<scalar_t>() + begin, grads[t].data_ptr<scalar_t>() + begin,
                        masters[t].data_ptr<float>() + begin, exp_avgs[t].data_ptr<float>() + begin,
                        exp_avg_sqs[t].data_ptr<float>() + begin, vmax, end - begin, s);
    });
  });
}

#ifdef GPUOPS_WITH_CUDA
void adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamStepOptions& options,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<void*> lists[6];
  const auto numel = detail::pointer_lists<6>(
      lists, {params, grads, exp_avgs, exp_avg_sqs, options.amsgrad ? max_exp_avg_sqs : exp_avg_sqs, steps});
  kernels::launch_adam_step(lists, numel, to_hyper(options),
                            detail::step_scalars(grad_scale, found_inf, options.lr_tensor),
                            c10::cuda::getCurrentCUDAStream());
}

void adam_master_cuda(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                      const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  c10::cuda::CUDAGuard guard(masters[0].device());
  std::vector<void*> lists[7];
  const auto numel = detail::pointer_lists<7>(lists, {params, grads, masters, exp_avgs, exp_avg_sqs,
                                              options.amsgrad ? max_exp_avg_sqs : exp_avg_sqs, steps});
  const auto dtype =
      params[0].scalar_type() == at::kBFloat16 ? kernels::GradDtype::BFloat16 : kernels::GradDtype::Float16;
  kernels::launch_adam_master_step(lists, numel, dtype, to_hyper(options),
                                   detail::step_scalars(grad_scale, found_inf, options.lr_tensor),
                                   c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

void adam_step_master_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                       at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                       at::TensorList steps, const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  // The float32 side (master, states, steps) as adam_step_ checks it, the masters standing in for the grads.
  check_all(master_params, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options, grad_scale,
            found_inf);
  detail::check_half_lists("adam_step_master_", params, grads, master_params);
  if (params.empty()) return;
  const at::Device device = master_params[0].device();
  if (device.is_cpu()) {
    return adam_master_cpu(params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options,
                           grad_scale, found_inf);
  }
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) {
    return adam_master_cuda(params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options,
                            grad_scale, found_inf);
  }
#endif
  TORCH_CHECK_VALUE(false, "adam_step_master_: device ", device, " is not supported");
}

void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamStepOptions& options,
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
