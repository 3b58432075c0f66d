#pragma once
// gpuops::amp::GradScaler: torch.amp.GradScaler for LibTorch C++ (which has none), with DeepSpeed's
// hysteresis, min/max scale and a skipped-step counter. The scale, growth tracker, hysteresis and
// overflow flags are device tensors; with gpuops' fused optimizers a step makes no host sync.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace torch::optim {
class Optimizer;
}

namespace gpuops::amp {

/// A fixed order of devices (type, then index), for maps keyed by device.
struct DeviceOrder {
  bool operator()(const c10::Device& a, const c10::Device& b) const {
    return a.type() != b.type() ? a.type() < b.type() : a.index() < b.index();
  }
};

/// torch.amp.GradScaler's constructor arguments and defaults, plus hysteresis (overflows tolerated
/// before the scale backs off, the budget restored when the scale grows, as DeepSpeed's default; 1 = torch),
/// min_scale and max_scale (0 = none).
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
  int64_t hysteresis = 1;
  double min_scale = 0.0;
  double max_scale = 0.0;
};

/// Throws c10::ValueError naming the option out of range: init_scale, min_scale and max_scale finite float32
/// values with 0 < init_scale, 0 <= min_scale <= init_scale <= max_scale (max_scale 0: none); growth_factor finite
/// and > 1; backoff_factor in (0, 1); growth_interval and hysteresis in [1, 2^31 - 1]. The one rule set of the C++
/// and the Python scaler (which calls it through gpuops._C) in constructors, setters and load_state_dict.
void check_grad_scaler_options(const GradScalerOptions& options, const std::string& where = "GradScaler");

/// The counters a checkpoint carries besides the options.
struct GradScalerCounters {
  int64_t growth_tracker = 0;   ///< clean steps since the last change of scale: [0, growth_interval)
  int64_t hysteresis_left = 1;  ///< overflows still tolerated before backing off: [1, hysteresis]
  int64_t skipped_steps = 0;    ///< [0, 2^53]
};

/// The scaler's checkpoint, with torch's names: scale, growth_factor, backoff_factor, growth_interval,
/// _growth_tracker; plus hysteresis, _hysteresis_left, min_scale, max_scale, _skipped_steps.
using GradScalerState = std::map<std::string, double>;

/// Reads a checkpoint (ours or torch's keys) into options, whose init_scale is the saved scale, and counters.
/// Keys it lacks keep `current`'s (`_hysteresis_left`: the loaded hysteresis, `_skipped_steps`: 0). Every value
/// is checked (the options as check_grad_scaler_options, counters whole numbers in range): c10::ValueError
/// naming the key. Both scalers' load_state_dict call it before they change anything.
std::pair<GradScalerOptions, GradScalerCounters> read_grad_scaler_state(const GradScalerState& state,
                                                                        const GradScalerOptions& current);

/// Checks a gradient divisor or a sample count: one element of a real (not bool or complex) dtype, on the CPU or
/// on `device` when given; a CPU value must be finite and > 0 (a device value is not read: no sync).
/// c10::ValueError "<where>: <name> ...".
void check_positive_count(const at::Tensor& value, const std::string& where, const char* name,
                          const std::optional<c10::Device>& device = std::nullopt);

class GradScaler {
 public:
  /// Throws c10::ValueError naming the option that is out of range.
  explicit GradScaler(GradScalerOptions options = {});

  /// loss * scale (the scale lives on the loss's device from the first call). Disabled: the loss itself.
  at::Tensor scale(const at::Tensor& loss);

  /// Until the next update(), also divides this optimizer's gradients by `divisor` (a number or a
  /// one-element tensor, e.g. an accumulation window's sample or token count), folded into the same
  /// unscale / clip / fused-step pass: no extra pass, no host sync. Before unscale_/clip_grad_norm_/step.
  /// c10::Error on a disabled scaler (it would not divide).
  void set_grad_divisor(torch::optim::Optimizer& optimizer, const at::Tensor& divisor);

  /// Divides the optimizer's gradients by the scale in place and records inf/nan, once per step.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// unscale_ + clip_grad_norm_ (L2) in one read of the gradients; returns the total unscaled norm (a
  /// device tensor). With gpuops' optimizers nothing is written: their step divides by scale / clip
  /// coefficient as it reads the gradients, so the AMP step is two passes over them.
  at::Tensor clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm);

  /// Steps the optimizer unless a gradient was inf/nan. gpuops::optim optimizers skip themselves on the
  /// device (no sync); any other torch::optim optimizer needs one read of the flag, as with torch.
  void step(torch::optim::Optimizer& optimizer);

  /// Ends the step: backs the scale off after hysteresis overflows, grows it after growth_interval clean
  /// steps, on the device.
  void update();

  double get_scale() const;        ///< host read
  int64_t skipped_steps() const;   ///< host read: steps skipped for inf/nan gradients
  /// Whether the last step() was applied, as a device bool tensor (no sync); undefined before any step.
  const at::Tensor& step_applied() const { return step_applied_; }
  bool is_enabled() const { return options_.enabled; }

  GradScalerState state_dict() const;
  /// Loads ours or torch's keys; nothing changes if a key is missing or out of range.
  void load_state_dict(const GradScalerState& state);

 private:
  enum class Stage { Ready, Unscaled, Clipped, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    std::map<c10::Device, at::Tensor, DeviceOrder> found_inf;  // float32[1] per device of the gradients
    at::Tensor grad_scale;                          // scale / clip coefficient, after clip_grad_norm_
    at::Tensor divisor;                             // set_grad_divisor's, or undefined
  };

  /// What the optimizer's gradients are divided by: the scale, times the divisor if one was set.
  at::Tensor gradient_scale(const PerOptimizer& state) const;

  void require_scale(const char* method) const;
  void record_found_inf(torch::optim::Optimizer& optimizer, PerOptimizer& state, const at::Tensor& inv_scale);
  at::Tensor combined_found_inf(const PerOptimizer& state) const;

  GradScalerOptions options_;
  int64_t init_growth_tracker_ = 0, init_hysteresis_left_ = 1, init_skipped_ = 0;
  at::Tensor scale_, growth_tracker_, hysteresis_left_, skipped_, step_applied_;
  std::map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace gpuops::amp
