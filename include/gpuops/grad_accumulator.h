#pragma once
// gpuops::GradAccumulator: gradient accumulation normalised by the true count of a window (the C++ twin
// of gpuops.GradAccumulator). Each micro-batch hands in the SUM of its per-sample (or per-token) losses and
// the count it covers; the window's gradient is the window's sum over its total count, never a mean of
// means. The count is known only at the window's end, so summed losses are back-propagated as they come
// and 1/count is folded into the scaler's gradient factor (GradScaler::set_grad_divisor): no extra pass.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include <ATen/core/Tensor.h>

#include "gpuops/grad_scaler.h"

namespace torch::optim {
class Optimizer;
}

namespace gpuops {

struct GradAccumulatorOptions {
  int64_t window = 1;                  ///< micro-batches per optimizer step (>= 1)
  std::optional<double> max_norm;      ///< clip the window's mean gradient (L2) before the step
  std::function<void()> on_boundary;   ///< called before each step (e.g. a sharded optimizer reduces)
};

/// Throws c10::ValueError unless window >= 1 and max_norm (when set) is finite and > 0. The Python
/// GradAccumulator calls it too (through gpuops._C).
void check_grad_accumulator_options(const GradAccumulatorOptions& options);

/// Throws c10::ValueError unless loss_sum is one floating value that requires grad and count is a positive
/// count (amp::check_positive_count) on the CPU or on loss_sum's device. Shared with the Python accumulator.
void check_micro_batch(const at::Tensor& loss_sum, const at::Tensor& count);

class GradAccumulator {
 public:
  /// `scaler`: an enabled GradScaler for fp16 (the loss is scaled per micro-batch and unscaled once per
  /// window, so an overflow anywhere skips the window); null or disabled: an internal scaler fixed at 1
  /// does the same bookkeeping. Both references must outlive the accumulator. c10::ValueError for a bad
  /// option.
  GradAccumulator(torch::optim::Optimizer& optimizer, GradAccumulatorOptions options,
                  amp::GradScaler* scaler = nullptr);

  /// Back-propagates `loss_sum` and adds `count` (> 0) to the window; true when the window completed and
  /// the optimizer stepped. Bad input (check_micro_batch) changes nothing.
  bool backward(const at::Tensor& loss_sum, const at::Tensor& count);
  bool backward(const at::Tensor& loss_sum, double count);

  /// Steps on a short last window (end of an epoch); false when the window is empty.
  bool flush();

  int64_t micro_batches() const { return micro_batches_; }
  /// With max_norm: the last window's mean-gradient norm (a device tensor).
  const at::Tensor& last_grad_norm() const { return last_grad_norm_; }

 private:
  amp::GradScaler& scaler();
  void step();

  torch::optim::Optimizer& optimizer_;
  GradAccumulatorOptions options_;
  amp::GradScaler* user_scaler_;
  std::unique_ptr<amp::GradScaler> unit_scaler_;
  at::Tensor count_, last_grad_norm_;
  int64_t micro_batches_ = 0;
};

}  // namespace gpuops
