#pragma once
// The fused SGD step over lists of tensors (torch.ops.gpuops.sgd_step_).
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace gpuops::optim {

struct SgdStepOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
  /// As AdamStepOptions::lr_tensor: the learning rate read on the device, replacing lr.
  std::optional<at::Tensor> lr_tensor;
};

/// Throws c10::ValueError unless every option is in range: lr, momentum and weight_decay finite and >= 0,
/// dampening in [0, 1], nesterov only with momentum > 0 and dampening 0. Shared by the C++ SGD, the Python
/// SGD (through gpuops._C) and the fused op, with torch's message text where torch checks.
void check_sgd_options(const SgdStepOptions& options, const std::string& where);

/// One step for every (param, grad, momentum_buffer, step) tuple (float32, dense, contiguous, one
/// device). momentum_buffers may be empty when momentum is 0. A step counter at 0 makes the buffer start
/// from this step's gradient, as torch does. grad_scale and found_inf as in adam_step_.
void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
               const SgdStepOptions& options, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf);

/// The same step for float16 or bfloat16 parameters with an fp32 master copy: grads in the parameters'
/// dtype; master_params and momentum_buffers float32 with the parameters' shapes. The update runs in
/// float32 on the master, which is then rounded to nearest even into the parameter.
void sgd_step_master_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                      at::TensorList momentum_buffers, at::TensorList steps, const SgdStepOptions& options,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

}  // namespace gpuops::optim
