// The fused optimizer steps as torch operators (torch.ops.gpuops.*), for the Python optimizers; registered for
// autograd, fake tensors and torch.compile by common/op_registration.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/op_registration.h"

#include "gpuops/fused_adam.h"
#include "gpuops/fused_adam8.h"
#include "gpuops/fused_sgd.h"

namespace {

void adam_step_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                  double eps, double weight_decay, bool decoupled, bool amsgrad, bool maximize,
                  const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& lr_tensor) {
  gpuops::optim::adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                            {lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, lr_tensor}, grad_scale,
                            found_inf);
}

void adam_step_master_op(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                         at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                         at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                         bool decoupled, bool amsgrad, bool maximize, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor) {
  gpuops::optim::adam_step_master_(params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                   {lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, lr_tensor},
                                   grad_scale, found_inf);
}

void adam8_step_op(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                   at::TensorList exp_avg_codes, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes,
                   at::TensorList exp_avg_sq_scales, at::TensorList steps, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& lr_tensor) {
  gpuops::optim::adam8_step_(params, grads, master_params, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes,
                             exp_avg_sq_scales, steps,
                             {lr, beta1, beta2, eps, weight_decay, decoupled, false, maximize, lr_tensor}, grad_scale,
                             found_inf);
}

void quantize_state_op(const at::Tensor& values, const at::Tensor& codes, const at::Tensor& scales, bool is_signed) {
  gpuops::optim::quantize_state_(values, codes, scales, is_signed);
}

void sgd_step_op(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
                 double lr, double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& lr_tensor) {
  gpuops::optim::sgd_step_(params, grads, momentum_buffers, steps,
                           {lr, momentum, dampening, weight_decay, nesterov, maximize, lr_tensor}, grad_scale,
                           found_inf);
}

void sgd_step_master_op(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                        at::TensorList momentum_buffers, at::TensorList steps, double lr, double momentum,
                        double dampening, double weight_decay, bool nesterov, bool maximize,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& lr_tensor) {
  gpuops::optim::sgd_step_master_(params, grads, master_params, momentum_buffers, steps,
                                  {lr, momentum, dampening, weight_decay, nesterov, maximize, lr_tensor}, grad_scale,
                                  found_inf);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuops, m) {
  using gpuops::ops::impl_mutating_op, gpuops::ops::no_outputs_meta_kernel;
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled, bool amsgrad, bool maximize, Tensor? grad_scale, Tensor? found_inf, "
      "Tensor? lr_tensor=None) -> ()");
  impl_mutating_op(m, "adam_step_", TORCH_FN(adam_step_op), no_outputs_meta_kernel());
  m.def(
      "adam_step_master_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] steps, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool decoupled, bool amsgrad, bool maximize, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? lr_tensor=None) -> ()");
  impl_mutating_op(m, "adam_step_master_", TORCH_FN(adam_step_master_op), no_outputs_meta_kernel());
  m.def(
      "adam8_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, Tensor(c!)[] exp_avg_codes, "
      "Tensor(d!)[] exp_avg_scales, Tensor(e!)[] exp_avg_sq_codes, Tensor(f!)[] exp_avg_sq_scales, "
      "Tensor(g!)[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
      "bool maximize, Tensor? grad_scale, Tensor? found_inf, Tensor? lr_tensor=None) -> ()");
  impl_mutating_op(m, "adam8_step_", TORCH_FN(adam8_step_op), no_outputs_meta_kernel());
  m.def("quantize_state_(Tensor values, Tensor(a!) codes, Tensor(b!) scales, bool is_signed) -> ()");
  impl_mutating_op(m, "quantize_state_", TORCH_FN(quantize_state_op), no_outputs_meta_kernel());
  m.def("dequantize_state(Tensor codes, Tensor scales, bool is_signed) -> Tensor");
  // A functional op with the same kernels: its checks read sizes, which fake tensors with symbolic shapes lack.
  m.impl("dequantize_state", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(gpuops::optim::dequantize_state)));
  m.impl("dequantize_state", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(gpuops::optim::dequantize_state)));
  m.impl("dequantize_state", torch::dispatch(c10::DispatchKey::Meta, [](const at::Tensor& codes, const at::Tensor&,
                                                                        bool) {
           return at::empty_like(codes, codes.options().dtype(at::kFloat));
         }));
  m.impl("dequantize_state", torch::dispatch(c10::DispatchKey::Autograd, gpuops::ops::non_differentiable_kernel()));
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] steps, float lr, "
      "float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? lr_tensor=None) -> ()");
  impl_mutating_op(m, "sgd_step_", TORCH_FN(sgd_step_op), no_outputs_meta_kernel());
  m.def(
      "sgd_step_master_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] momentum_buffers, Tensor(d!)[] steps, float lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize, Tensor? grad_scale, Tensor? found_inf, "
      "Tensor? lr_tensor=None) -> ()");
  impl_mutating_op(m, "sgd_step_master_", TORCH_FN(sgd_step_master_op), no_outputs_meta_kernel());
}
