// gpuops::amp::GradScaler (grad_scaler.h): the C++ twin of python/gpuops/amp.py's GradScaler, over the same
// device-side ops (unscale.cpp, grad_norm.cpp, scale_update.cpp).
#include "gpuops/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include "gpuops/amp.h"
#include "gpuops/optimizers.h"

namespace gpuops::amp {
namespace {

// The optimizer's gradients grouped by device (fixed order: std::map by device).
std::map<c10::Device, std::vector<at::Tensor>, DeviceOrder> grads_by_device(const torch::optim::Optimizer& optimizer) {
  std::map<c10::Device, std::vector<at::Tensor>, DeviceOrder> grads;
  for (const auto& group : optimizer.param_groups())
    for (const at::Tensor& p : group.params())
      if (p.grad().defined()) grads[p.grad().device()].push_back(p.grad());
  TORCH_CHECK(!grads.empty(), "GradScaler: the optimizer has no gradients; call backward() on scaler.scale(loss) "
              "before unscale_(), clip_grad_norm_() or step()");
  return grads;
}

void check(const GradScalerOptions& o) {
  TORCH_CHECK_VALUE(o.init_scale > 0, "GradScaler: init_scale must be > 0, got ", o.init_scale);
  TORCH_CHECK_VALUE(o.growth_factor > 1, "GradScaler: growth_factor must be > 1, got ", o.growth_factor);
  TORCH_CHECK_VALUE(o.backoff_factor > 0 && o.backoff_factor < 1, "GradScaler: backoff_factor must be in (0, 1), got ",
                    o.backoff_factor);
  TORCH_CHECK_VALUE(o.growth_interval >= 1, "GradScaler: growth_interval must be >= 1, got ", o.growth_interval);
  TORCH_CHECK_VALUE(o.hysteresis >= 1, "GradScaler: hysteresis must be >= 1, got ", o.hysteresis);
  TORCH_CHECK_VALUE(o.min_scale >= 0 && (o.max_scale == 0 || o.max_scale >= o.min_scale),
                    "GradScaler: need 0 <= min_scale <= max_scale (max_scale 0: none), got min_scale=", o.min_scale,
                    ", max_scale=", o.max_scale);
}

at::Tensor zero_flag(c10::Device device) { return at::zeros({1}, at::TensorOptions(device).dtype(at::kFloat)); }

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options), init_hysteresis_left_(options.hysteresis) {
  check(options_);
}

void GradScaler::require_scale(const char* method) const {
  TORCH_CHECK(scale_.defined(), "GradScaler.", method, "() before any scale(): scale the loss with scaler.scale(loss) "
              "and call backward() on it first");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!options_.enabled) return loss;
  if (!scale_.defined()) {
    const auto on = at::TensorOptions(loss.device());
    scale_ = at::full({1}, options_.init_scale, on.dtype(at::kFloat));
    growth_tracker_ = at::full({1}, init_growth_tracker_, on.dtype(at::kInt));
    hysteresis_left_ = at::full({1}, init_hysteresis_left_, on.dtype(at::kInt));
    skipped_ = at::full({1}, init_skipped_, on.dtype(at::kLong));
  }
  return loss * scale_.to(loss.device(), /*non_blocking=*/true);
}

void GradScaler::record_found_inf(torch::optim::Optimizer& optimizer, PerOptimizer& state,
                                  const at::Tensor& inv_scale) {
  c10::NoGradGuard no_grad;
  for (auto& [device, grads] : grads_by_device(optimizer)) {
    at::Tensor found_inf = zero_flag(device);
    unscale_and_check_(grads, found_inf, inv_scale.to(device, /*non_blocking=*/true));
    state.found_inf[device] = found_inf;
  }
}

at::Tensor GradScaler::gradient_scale(const PerOptimizer& state) const {
  return state.divisor.defined() ? scale_ * state.divisor : scale_;
}

void GradScaler::set_grad_divisor(torch::optim::Optimizer& optimizer, const at::Tensor& divisor) {
  require_scale("set_grad_divisor");
  TORCH_CHECK_VALUE(divisor.numel() == 1, "GradScaler.set_grad_divisor: divisor must have one element, got ",
                    divisor.numel());
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage == Stage::Ready, "GradScaler.set_grad_divisor() must come before unscale_(), "
              "clip_grad_norm_() and step() of this step");
  state.divisor = divisor.detach().to(scale_.device(), at::kFloat, /*non_blocking=*/true).reshape({1});
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::Unscaled, "GradScaler.unscale_() was already called for this optimizer since "
              "the last update(); call it once per step, after backward() and before step()");
  TORCH_CHECK(state.stage != Stage::Stepped, "GradScaler.unscale_() was called after step(); call it before "
              "step(), then update() ends the step");
  TORCH_CHECK(state.stage != Stage::Clipped, "GradScaler.unscale_() after clip_grad_norm_(): clip_grad_norm_ "
              "already accounts for the scale; call step() next");
  require_scale("unscale_");
  record_found_inf(optimizer, state, gradient_scale(state).to(at::kDouble).reciprocal().to(at::kFloat));
  state.stage = Stage::Unscaled;
}

at::Tensor GradScaler::clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, "GradScaler.clip_grad_norm_: max_norm must be > 0, got ", max_norm);
  c10::NoGradGuard no_grad;
  PerOptimizer& state = per_optimizer_[&optimizer];
  if (options_.enabled) {
    TORCH_CHECK(state.stage == Stage::Ready, "GradScaler.clip_grad_norm_() must come right after backward(), "
                "before unscale_() and step(), once per step");
    require_scale("clip_grad_norm_");
  }
  const auto grads = grads_by_device(optimizer);
  const c10::Device home = options_.enabled ? scale_.device() : grads.begin()->first;
  const at::Tensor inv_scale = options_.enabled
                                   ? gradient_scale(state).to(at::kDouble).reciprocal().to(at::kFloat)
                                   : at::ones({1}, at::TensorOptions(home).dtype(at::kFloat));
  std::vector<at::Tensor> norms;
  for (const auto& [device, device_grads] : grads) {
    at::Tensor found_inf = zero_flag(device);
    norms.push_back(unscaled_grad_norm_(device_grads, inv_scale.to(device), found_inf).to(home));
    if (options_.enabled) state.found_inf[device] = found_inf;
  }
  const at::Tensor total = norms.size() > 1 ? at::stack(norms).square().sum().sqrt() : norms[0].reshape({});
  const at::Tensor clip_coef = (max_norm / (total + 1e-6)).clamp_max(1.0).to(at::kFloat);
  if (options_.enabled && dynamic_cast<optim::FusedOptimizer*>(&optimizer) != nullptr) {
    state.grad_scale = (gradient_scale(state) / clip_coef).reshape({1});
    state.stage = Stage::Clipped;
    return total;
  }
  // Any other reader takes the gradients as they are: write them unscaled and clipped, in one pass.
  const at::Tensor factor = (inv_scale * clip_coef).reshape({1});
  for (const auto& [device, device_grads] : grads) unscale_and_check_(device_grads, zero_flag(device), factor.to(device));
  if (options_.enabled) state.stage = Stage::Unscaled;
  return total;
}

at::Tensor GradScaler::combined_found_inf(const PerOptimizer& state) const {
  std::vector<at::Tensor> flags;
  const c10::Device first = state.found_inf.begin()->first;
  for (const auto& [device, flag] : state.found_inf) flags.push_back(flag.to(first, /*non_blocking=*/true));
  return flags.size() == 1 ? flags[0] : at::stack(flags).sum(0);
}

void GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return;
  }
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::Stepped, "GradScaler.step() was already called for this optimizer since the "
              "last update(); call update() to end the step");
  require_scale("step");
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer)) {
    // Sync-free: the optimizer divides by the scale as it reads and skips itself on the flag.
    std::optional<at::Tensor> grad_scale;
    if (state.stage == Stage::Ready) {
      record_found_inf(optimizer, state, at::ones_like(scale_));  // check only
      grad_scale = gradient_scale(state);
    } else if (state.stage == Stage::Clipped) {
      grad_scale = state.grad_scale;
    }
    const at::Tensor found = combined_found_inf(state);
    fused->step_scaled(grad_scale, found);
    step_applied_ = found == 0;
  } else {
    if (state.stage == Stage::Ready) unscale_(optimizer);
    const at::Tensor found = combined_found_inf(state);
    step_applied_ = found == 0;
    if (found.item<float>() == 0) optimizer.step();  // torch optimizers cannot skip on a device flag
  }
  state.stage = Stage::Stepped;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  require_scale("update");
  std::vector<at::Tensor> flags;
  for (const auto& [optimizer, state] : per_optimizer_)
    for (const auto& [device, flag] : state.found_inf) flags.push_back(flag.to(scale_.device(), true));
  TORCH_CHECK(!flags.empty(), "GradScaler.update(): no unscale_() or step() was recorded since the last update(); "
              "call scaler.step(optimizer) before update()");
  const at::Tensor found = at::stack(flags).sum(0);
  ScaleUpdateOptions o;
  o.growth_factor = options_.growth_factor;
  o.backoff_factor = options_.backoff_factor;
  o.growth_interval = options_.growth_interval;
  o.hysteresis = options_.hysteresis;
  o.min_scale = options_.min_scale;
  o.max_scale = options_.max_scale;
  update_scale_(scale_, growth_tracker_, hysteresis_left_, found, o);
  skipped_.add_((found > 0).to(at::kLong));
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<float>() : options_.init_scale;
}

int64_t GradScaler::skipped_steps() const { return skipped_.defined() ? skipped_.item<int64_t>() : init_skipped_; }

GradScalerState GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  const auto read = [](const at::Tensor& t, int64_t fallback) {
    return static_cast<double>(t.defined() ? t.item<int64_t>() : fallback);
  };
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", read(growth_tracker_, init_growth_tracker_)},
          {"hysteresis", static_cast<double>(options_.hysteresis)},
          {"_hysteresis_left", read(hysteresis_left_, init_hysteresis_left_)},
          {"min_scale", options_.min_scale},
          {"max_scale", options_.max_scale},
          {"_skipped_steps", static_cast<double>(skipped_steps())}};
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  if (!options_.enabled) return;
  TORCH_CHECK_VALUE(!state.empty(), "GradScaler.load_state_dict: the state is empty (it came from a disabled scaler)");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    TORCH_CHECK_VALUE(state.count(key), "GradScaler.load_state_dict: missing key '", key, "'");
  const auto get = [&](const char* key, double fallback) {
    const auto it = state.find(key);
    return it == state.end() ? fallback : it->second;
  };
  GradScalerOptions loaded = options_;
  loaded.init_scale = get("scale", 0);
  loaded.growth_factor = get("growth_factor", 0);
  loaded.backoff_factor = get("backoff_factor", 0);
  loaded.growth_interval = static_cast<int64_t>(get("growth_interval", 0));
  loaded.hysteresis = static_cast<int64_t>(get("hysteresis", static_cast<double>(options_.hysteresis)));
  loaded.min_scale = get("min_scale", options_.min_scale);
  loaded.max_scale = get("max_scale", options_.max_scale);
  check(loaded);  // throws before anything changes
  options_ = loaded;
  init_growth_tracker_ = static_cast<int64_t>(get("_growth_tracker", 0));
  init_hysteresis_left_ = static_cast<int64_t>(get("_hysteresis_left", static_cast<double>(loaded.hysteresis)));
  init_skipped_ = static_cast<int64_t>(get("_skipped_steps", 0));
  if (scale_.defined()) {
    scale_.fill_(options_.init_scale);
    growth_tracker_.fill_(init_growth_tracker_);
    hysteresis_left_.fill_(init_hysteresis_left_);
    skipped_.fill_(init_skipped_);
  }
}

}  // namespace gpuops::amp
