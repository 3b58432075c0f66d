// sgd_step_: argument checks, then the CPU loop or the CUDA multi-tensor launcher (same element math).
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include "../common/cpu_parallel.h"
#include "gpuops/fused_sgd.h"
#include "math/sgd_math.h"
#include "optim_checks.h"
#include "option_checks.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "pointer_lists.h"
#include "sgd_kernels.h"
#endif

namespace gpuops::optim {
namespace {

math::SgdHyper to_hyper(const SgdStepOptions& o) {
  return {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, o.maximize};
}

// The CPU steps' hyper-parameters: a CPU lr tensor is read here (a plain load).
math::SgdHyper to_cpu_hyper(const SgdStepOptions& o) {
  math::SgdHyper hyper = to_hyper(o);
  if (o.lr_tensor) hyper.lr = *o.lr_tensor->data_ptr<float>();
  return hyper;
}

// The CPU step over every tensor's pieces (common/cpu_parallel.h), with this optimizer's per-step constants.
template <typename Body>
void for_each_applied_piece(at::TensorList tensors, at::TensorList steps, const SgdStepOptions& options,
                            const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                            const Body& body) {
  const auto hyper = to_cpu_hyper(options);
  auto constants = [&](float step, float factor) { return math::make_sgd_step(hyper, step == 0.0f, factor); };
  cpu::for_each_applied_piece(tensors, steps, grad_scale, found_inf, constants, body);
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList buffers, at::TensorList steps,
             const SgdStepOptions& options, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf) {
  for_each_applied_piece(params, steps, options, grad_scale, found_inf,
                         [&](size_t t, int64_t begin, int64_t end, const math::SgdStep& s) {
    float* param = params[t].data_ptr<float>();
    const float* grad = grads[t].data_ptr<float>();
    float* buf = options.momentum != 0.0 ? buffers[t].data_ptr<float>() : nullptr;
    float unused = 0.0f;
    for (int64_t i = begin; i < end; ++i) math::sgd_update(param[i], grad[i], buf ? buf[i] : unused, s);
  });
}

void sgd_master_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList buffers,
                    at::TensorList steps, const SgdStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  for_each_applied_piece(masters, steps, options, grad_scale, found_inf,
                         [&](size_t t, int64_t begin, int64_t end, const math::SgdStep& s) {
    float* master = masters[t].data_ptr<float>();
    float* buf = options.momentum != 0.0 ? buffers[t].data_ptr<float>() : nullptr;
    AT_DISPATCH_REDUCED_FLOATING_TYPES(params[t].scalar_type(), "sgd_step_master_", [&] {
      scalar_t* param = params[t].data_ptr<scalar_t>();
      const scalar_t* grad = grads[t].data_ptr<scalar_t>();
      float unused = 0.0f;
      for (int64_t i = begin; i < end; ++i) {
        math::sgd_update(master[i], static_cast<float>(grad[i]), buf ? buf[i] : unused, s);
        param[i] = static_cast<scalar_t>(master[i]);  // round to nearest even
      }
    });
  });
}

#ifdef GPUOPS_WITH_CUDA
void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList buffers, at::TensorList steps,
              const SgdStepOptions& options, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<void*> lists[4];
  const auto numel =
      detail::pointer_lists<4>(lists, {params, grads, options.momentum != 0.0 ? buffers : params, steps});
  kernels::launch_sgd_step(lists, numel, to_hyper(options),
                           detail::step_scalars(grad_scale, found_inf, options.lr_tensor),
                           c10::cuda::getCurrentCUDAStream());
}

void sgd_master_cuda(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList buffers,
                     at::TensorList steps, const SgdStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  c10::cuda::CUDAGuard guard(masters[0].device());
  std::vector<void*> lists[5];
  const auto numel = detail::pointer_lists<5>(
      lists, {params, grads, masters, options.momentum != 0.0 ? buffers : masters, steps});
  const auto dtype =
      params[0].scalar_type() == at::kBFloat16 ? kernels::GradDtype::BFloat16 : kernels::GradDtype::Float16;
  kernels::launch_sgd_master_step(lists, numel, dtype, to_hyper(options),
                                  detail::step_scalars(grad_scale, found_inf, options.lr_tensor),
                                  c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

void check_sgd_options(const SgdStepOptions& o, const std::string& where) {
  using gpuops::detail::check_option;
  check_option(std::isfinite(o.lr) && o.lr >= 0.0, where, "Invalid learning rate", o.lr,
               "lr must be a finite number >= 0");
  check_option(std::isfinite(o.momentum) && o.momentum >= 0.0, where, "Invalid momentum value", o.momentum,
               "momentum must be a finite number >= 0");
  check_option(o.dampening >= 0.0 && o.dampening <= 1.0, where, "Invalid dampening value", o.dampening,
               "dampening must be in [0, 1]");
  check_option(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0, where, "Invalid weight_decay value",
               o.weight_decay, "weight_decay must be a finite number >= 0");
  TORCH_CHECK_VALUE(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0), where,
                    ": Nesterov momentum requires a momentum and zero dampening (got momentum=",
                    gpuops::detail::py_repr(o.momentum), ", dampening=", gpuops::detail::py_repr(o.dampening), ")");
}

void sgd_step_master_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                      at::TensorList momentum_buffers, at::TensorList steps, const SgdStepOptions& options,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_sgd_options(options, "sgd_step_master_");
  if (options.momentum != 0.0) {
    detail::check_step_lists("sgd_step_master_", master_params, {{"momentum_buffers", momentum_buffers}}, steps,
                             grad_scale, found_inf, options.lr_tensor);
  } else {
    detail::check_step_lists("sgd_step_master_", master_params, {}, steps, grad_scale, found_inf, options.lr_tensor);
  }
  detail::check_half_lists("sgd_step_master_", params, grads, master_params);
  if (params.empty()) return;
  const at::Device device = master_params[0].device();
  if (device.is_cpu()) {
    return sgd_master_cpu(params, grads, master_params, momentum_buffers, steps, options, grad_scale, found_inf);
  }
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) {
    return sgd_master_cuda(params, grads, master_params, momentum_buffers, steps, options, grad_scale, found_inf);
  }
#endif
  TORCH_CHECK_VALUE(false, "sgd_step_master_: device ", device, " is not supported");
}

void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
               const SgdStepOptions& options, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  check_sgd_options(options, "sgd_step_");
  if (options.momentum != 0.0) {
    detail::check_step_lists("sgd_step_", params, {{"grads", grads}, {"momentum_buffers", momentum_buffers}}, steps,
                             grad_scale, found_inf, options.lr_tensor);
  } else {
    detail::check_step_lists("sgd_step_", params, {{"grads", grads}}, steps, grad_scale, found_inf, options.lr_tensor);
  }
  if (params.empty()) return;
  const at::Device device = params[0].device();
  if (device.is_cpu()) return sgd_cpu(params, grads, momentum_buffers, steps, options, grad_scale, found_inf);
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) return sgd_cuda(params, grads, momentum_buffers, steps, options, grad_scale, found_inf);
#endif
  TORCH_CHECK_VALUE(false, "sgd_step_: device ", device, " is not supported");
}

}  // namespace gpuops::optim
