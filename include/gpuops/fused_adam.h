#pragma once
// The fused Adam/AdamW step over lists of tensors (torch.ops.gpuops.adam_step_); the optimizer
// classes call it once per parameter group and device.
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace gpuops::optim {

struct AdamStepOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;  ///< AdamW; false: Adam with L2 weight decay
  bool amsgrad = false;
  bool maximize = false;
  /// When set (float32, one element, on the parameters' device), the step reads the learning rate from it
  /// on the device instead of using lr: a step captured in a CUDA graph then follows an LR schedule that
  /// writes this tensor (as torch's capturable optimizers take a tensor lr).
  std::optional<at::Tensor> lr_tensor;
};

/// Throws c10::ValueError unless every option is in range: lr, eps and weight_decay finite and >= 0, betas in
/// [0, 1). The one rule set of the C++ AdamW, the Python Adam/AdamW (through gpuops._C) and the fused op:
/// torch's ranges and message text ("Invalid learning rate: -1.0"), plus finiteness, which torch does not
/// check. `where` starts the message (e.g. "AdamW: param_groups[1]").
void check_adam_options(const AdamStepOptions& options, const std::string& where);

/// One step for every (param, grad, exp_avg, exp_avg_sq[, max_exp_avg_sq], step) tuple: float32, dense,
/// contiguous, one device. grad_scale (float32[1]): divide the gradients by it as they are read (a
/// GradScaler's scale). found_inf (float32[1]): when non-zero nothing changes, not even the steps.
/// max_exp_avg_sqs may be empty unless amsgrad. Bad arguments raise c10::ValueError before anything
/// is written.
void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamStepOptions& options,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

/// The same step for float16 or bfloat16 parameters with an fp32 master copy: grads in the
/// parameters' dtype; master_params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs) float32 with the
/// parameters' shapes. The update runs in float32 on the master, which is then rounded to nearest even
/// into the parameter. Same grad_scale / found_inf contract; bad arguments raise c10::ValueError before
/// anything is written.
void adam_step_master_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                       at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                       at::TensorList steps, const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf);

}  // namespace gpuops::optim
