// gpuops::GradAccumulator (grad_accumulator.h), over GradScaler's gradient divisor.
#include "gpuops/grad_accumulator.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

namespace gpuops {

GradAccumulator::GradAccumulator(torch::optim::Optimizer& optimizer, GradAccumulatorOptions options,
                                 amp::GradScaler* scaler)
    : optimizer_(optimizer),
      options_(std::move(options)),
      user_scaler_(scaler != nullptr && scaler->is_enabled() ? scaler : nullptr) {
  TORCH_CHECK_VALUE(options_.window >= 1, "GradAccumulator: window must be >= 1, got ", options_.window);
  TORCH_CHECK_VALUE(!options_.max_norm || *options_.max_norm > 0, "GradAccumulator: max_norm must be > 0, got ",
                    options_.max_norm.value_or(0));
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
  TORCH_CHECK_VALUE(loss_sum.numel() == 1, "GradAccumulator.backward: loss_sum must be one value, got shape ",
                    loss_sum.sizes());
  TORCH_CHECK_VALUE(count.numel() == 1, "GradAccumulator.backward: count must be one value, got shape ",
                    count.sizes());
  const at::Tensor c = count.detach().to(loss_sum.device(), at::kFloat).reshape({1});
  if (c.is_cpu()) {  // (a device count is not read: no sync)
    TORCH_CHECK_VALUE(c.item<float>() > 0, "GradAccumulator.backward: count must be > 0, got ", c.item<float>());
  }
  count_ = count_.defined() ? count_ + c : c;
  scaler().scale(loss_sum).backward();
  if (++micro_batches_ < options_.window) return false;
  step();
  return true;
}

bool GradAccumulator::backward(const at::Tensor& loss_sum, double count) {
  return backward(loss_sum, at::scalar_tensor(count, at::kFloat));
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
