// gpuops::GradAccumulator (grad_accumulator.h), over GradScaler's gradient divisor.
#include "gpuops/grad_accumulator.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include "../optim/option_checks.h"

namespace gpuops {

void check_grad_accumulator_options(const GradAccumulatorOptions& o) {
  gpuops::detail::check_option(o.window >= 1, "GradAccumulator", "Invalid window value", o.window,
                       "window must be an integer >= 1");
  if (o.max_norm) {
    gpuops::detail::check_option(std::isfinite(*o.max_norm) && *o.max_norm > 0, "GradAccumulator", "Invalid max_norm value",
                         *o.max_norm, "max_norm must be a finite number > 0, or none");
  }
}

void check_micro_batch(const at::Tensor& loss_sum, const at::Tensor& count) {
  const char* where = "GradAccumulator.backward";
  TORCH_CHECK_VALUE(loss_sum.defined() && loss_sum.numel() == 1 && loss_sum.is_floating_point(), where,
                    ": loss_sum must be one floating value (the sum of the micro-batch's losses), got ",
                    loss_sum.defined() ? loss_sum.toString() + " of shape " + c10::str(loss_sum.sizes())
                                       : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(loss_sum.requires_grad(), where, ": loss_sum does not require grad: compute it from the "
                    "model's output with grad enabled");
  amp::check_positive_count(count, where, "count", loss_sum.device());
}

GradAccumulator::GradAccumulator(torch::optim::Optimizer& optimizer, GradAccumulatorOptions options,
                                 amp::GradScaler* scaler)
    : optimizer_(optimizer),
      options_(std::move(options)),
      user_scaler_(scaler != nullptr && scaler->is_enabled() ? scaler : nullptr) {
  check_grad_accumulator_options(options_);
}

amp::GradScaler& GradAccumulator::scaler() {
  if (user_scaler_ != nullptr) return *user_scaler_;
  if (!unit_scaler_) {  // scale fixed at 1: only the divisor and the inf/nan skip remain
    amp::GradScalerOptions unit;
    unit.init_scale = unit.min_scale = unit.max_scale = 1.0;
    unit_scaler_ = std::make_unique<amp::GradScaler>(unit);
  }
  return *unit_scaler_;
}

bool GradAccumulator::backward(const at::Tensor& loss_sum, const at::Tensor& count) {
  check_micro_batch(loss_sum, count);
  const at::Tensor c = count.detach().to(loss_sum.device(), at::kFloat).reshape({1});
  const at::Tensor total = count_.defined() ? count_ + c : c;
  scaler().scale(loss_sum).backward();
  count_ = total;  // only once backward went through
  if (++micro_batches_ < options_.window) return false;
  step();
  return true;
}

bool GradAccumulator::backward(const at::Tensor& loss_sum, double count) {
  return backward(loss_sum, at::scalar_tensor(count, at::kDouble));  // checked before any rounding
}

bool GradAccumulator::flush() {
  if (micro_batches_ == 0) return false;
  step();
  return true;
}

void GradAccumulator::step() {
  if (options_.on_boundary) options_.on_boundary();
  amp::GradScaler& s = scaler();
  s.set_grad_divisor(optimizer_, count_);
  if (options_.max_norm) last_grad_norm_ = s.clip_grad_norm_(optimizer_, *options_.max_norm);
  s.step(optimizer_);
  s.update();
  optimizer_.zero_grad();
  count_ = at::Tensor();
  micro_batches_ = 0;
}

}  // namespace gpuops
