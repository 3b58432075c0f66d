// gpuops::amp::GradScaler (grad_scaler.h): the C++ twin of python/gpuops/amp.py's GradScaler, over the same
// device-side ops (unscale.cpp, grad_norm.cpp, scale_update.cpp).
#include "gpuops/grad_scaler.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include "../optim/option_checks.h"
#include "gpuops/amp.h"
#include "gpuops/optimizers.h"

namespace gpuops::amp {
namespace {

// The optimizer's gradients grouped by device (fixed order: std::map by device).
// A sharded optimizer reduces its gradients first (prepare_gradients).
std::map<c10::Device, std::vector<at::Tensor>, DeviceOrder> grads_by_device(torch::optim::Optimizer& optimizer) {
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer)) fused->prepare_gradients();
  std::map<c10::Device, std::vector<at::Tensor>, DeviceOrder> grads;
  for (const auto& group : optimizer.param_groups())
    for (const at::Tensor& p : group.params())
      if (p.grad().defined()) grads[p.grad().device()].push_back(p.grad());
  TORCH_CHECK(!grads.empty(), "GradScaler: the optimizer has no gradients; call backward() on scaler.scale(loss) "
              "before unscale_(), clip_grad_norm_() or step()");
  return grads;
}

// A sharded optimizer's flag covers every rank (global_found_inf).
at::Tensor global_found_inf(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf) {
  auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer);
  return fused ? fused->global_found_inf(found_inf) : found_inf;
}

at::Tensor zero_flag(c10::Device device) { return at::zeros({1}, at::TensorOptions(device).dtype(at::kFloat)); }

}  // namespace

void check_grad_scaler_options(const GradScalerOptions& o, const std::string& where) {
  using gpuops::detail::check_option;
  constexpr double max_float = std::numeric_limits<float>::max();
  constexpr int64_t max_int32 = std::numeric_limits<int32_t>::max();
  // The scales live in float32 tensors: a double beyond float32 would become inf (or 0) there.
  check_option(o.init_scale >= std::numeric_limits<float>::denorm_min() && o.init_scale <= max_float, where,
               "Invalid init_scale value", o.init_scale, "init_scale must be a float32 number > 0, at most 3.4e+38");
  check_option(std::isfinite(o.growth_factor) && o.growth_factor > 1.0 && o.growth_factor <= max_float, where,
               "Invalid growth_factor value", o.growth_factor, "growth_factor must be a finite number > 1");
  check_option(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, where, "Invalid backoff_factor value",
               o.backoff_factor, "backoff_factor must be in (0, 1)");
  check_option(o.growth_interval >= 1 && o.growth_interval <= max_int32, where, "Invalid growth_interval value",
               o.growth_interval, "growth_interval must be an integer in [1, 2147483647]");
  check_option(o.hysteresis >= 1 && o.hysteresis <= max_int32, where, "Invalid hysteresis value", o.hysteresis,
               "hysteresis must be an integer in [1, 2147483647]");
  check_option(o.min_scale >= 0.0 && o.min_scale <= max_float, where, "Invalid min_scale value", o.min_scale,
               "min_scale must be a float32 number >= 0");
  check_option(o.max_scale == 0.0 || (o.max_scale >= o.min_scale && o.max_scale <= max_float), where,
               "Invalid max_scale value", o.max_scale,
               "max_scale must be 0 (no maximum) or a float32 number >= min_scale=" + gpuops::detail::py_repr(o.min_scale));
  check_option(o.init_scale >= o.min_scale && (o.max_scale == 0.0 || o.init_scale <= o.max_scale), where,
               "Invalid init_scale value", o.init_scale,
               "init_scale must be in [min_scale, max_scale] = [" + gpuops::detail::py_repr(o.min_scale) + ", " +
                   (o.max_scale == 0.0 ? std::string("inf") : gpuops::detail::py_repr(o.max_scale)) + "]");
}

std::pair<GradScalerOptions, GradScalerCounters> read_grad_scaler_state(const GradScalerState& state,
                                                                        const GradScalerOptions& current) {
  const std::string where = "GradScaler.load_state_dict";
  TORCH_CHECK_VALUE(!state.empty(), where, ": the state is empty (it came from a disabled scaler)");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    TORCH_CHECK_VALUE(state.count(key), where, ": missing key '", key, "'");
  const auto get = [&](const char* key, double fallback) {
    const auto it = state.find(key);
    return it == state.end() ? fallback : it->second;
  };
  // A counter must be a whole number in range before it is cast: a cast of NaN or 1e30 is undefined.
  const auto integer = [&](const char* key, double fallback, double low, double high) {
    const double v = get(key, fallback);
    gpuops::detail::check_option(gpuops::detail::is_integer_in(v, low, high), where, (std::string("Invalid ") + key + " value").c_str(),
                         v, std::string(key) + " must be an integer in [" + gpuops::detail::py_repr(static_cast<int64_t>(low)) +
                                ", " + gpuops::detail::py_repr(static_cast<int64_t>(high)) + "]");
    return static_cast<int64_t>(v);
  };
  constexpr double max_int32 = std::numeric_limits<int32_t>::max();
  GradScalerOptions o = current;
  o.init_scale = get("scale", 0);
  o.growth_factor = get("growth_factor", 0);
  o.backoff_factor = get("backoff_factor", 0);
  o.growth_interval = integer("growth_interval", 0, 1, max_int32);
  o.hysteresis = integer("hysteresis", static_cast<double>(current.hysteresis), 1, max_int32);
  o.min_scale = get("min_scale", current.min_scale);
  o.max_scale = get("max_scale", current.max_scale);
  check_grad_scaler_options(o, where);
  GradScalerCounters c;
  c.growth_tracker = integer("_growth_tracker", 0, 0, static_cast<double>(o.growth_interval - 1));
  c.hysteresis_left = integer("_hysteresis_left", static_cast<double>(o.hysteresis), 1, static_cast<double>(o.hysteresis));
  c.skipped_steps = integer("_skipped_steps", 0, 0, 9007199254740992.0);  // 2^53: exact in the double state
  return {o, c};
}

void check_positive_count(const at::Tensor& value, const std::string& where, const char* name,
                          const std::optional<c10::Device>& device) {
  TORCH_CHECK_VALUE(value.defined() && value.numel() == 1, where, ": ", name, " must be one number, got ",
                    value.defined() ? "a tensor of shape " + c10::str(value.sizes()) : std::string("an undefined tensor"));
  const auto dtype = value.scalar_type();
  TORCH_CHECK_VALUE(at::isFloatingType(dtype) || (at::isIntegralType(dtype, /*includeBool=*/false)), where, ": ",
                    name, " must be a real number, got a ", dtype, " tensor");
  TORCH_CHECK_VALUE(value.is_cpu() || !device || value.device() == *device, where, ": ", name, " is on ",
                    value.device(), " but must be on the CPU or on ", device ? device->str() : std::string("?"));
  if (value.is_cpu()) {  // a device value is not read: that would be a host sync
    const double v = value.item<double>();
    // The scaler divides by it in float32: it must be a float32 number > 0 there.
    const bool in_float32 = v >= std::numeric_limits<float>::denorm_min() && v <= std::numeric_limits<float>::max();
    gpuops::detail::check_option(in_float32, where,
                         ("Invalid " + std::string(name) + " value").c_str(), v,
                         std::string(name) + " must be a finite float32 number > 0");
  }
}

GradScaler::GradScaler(GradScalerOptions options) : options_(options), init_hysteresis_left_(options.hysteresis) {
  check_grad_scaler_options(options_);
}

void GradScaler::require_scale(const char* method) const {
  TORCH_CHECK(scale_.defined(), "GradScaler.", method, "() before any scale(): scale the loss with scaler.scale(loss) "
              "and call backward() on it first");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  TORCH_CHECK_VALUE(loss.defined(), "GradScaler.scale: loss is an undefined tensor");
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
    state.found_inf[device] = global_found_inf(optimizer, found_inf);
  }
}

at::Tensor GradScaler::gradient_scale(const PerOptimizer& state) const {
  return state.divisor.defined() ? scale_ * state.divisor : scale_;
}

void GradScaler::set_grad_divisor(torch::optim::Optimizer& optimizer, const at::Tensor& divisor) {
  // A disabled scaler steps the optimizer as it is: a divisor would be silently ignored.
  TORCH_CHECK(options_.enabled, "GradScaler.set_grad_divisor: the scaler is disabled, so nothing would divide the "
              "gradients; divide the loss instead, or use GradAccumulator (which keeps its own scaler)");
  require_scale("set_grad_divisor");
  check_positive_count(divisor, "GradScaler.set_grad_divisor", "divisor", scale_.device());
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage == Stage::Ready, "GradScaler.set_grad_divisor() must come before unscale_(), "
              "clip_grad_norm_() and step() of this step");
  state.divisor = divisor.detach().to(scale_.device(), at::kFloat, /*non_blocking=*/true).reshape({1});
  // A sharded optimizer: the mean of every rank's divisor (its gradients are averaged over ranks).
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer)) state.divisor = fused->global_divisor(state.divisor);
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
    if (options_.enabled) state.found_inf[device] = global_found_inf(optimizer, found_inf);
  }
  at::Tensor total = norms.size() > 1 ? at::stack(norms).square().sum().sqrt() : norms[0].reshape({});
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer)) total = fused->global_grad_norm(total);
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
  const auto [loaded, counters] = read_grad_scaler_state(state, options_);  // throws before anything changes
  options_ = loaded;
  init_growth_tracker_ = counters.growth_tracker;
  init_hysteresis_left_ = counters.hysteresis_left;
  init_skipped_ = counters.skipped_steps;
  if (scale_.defined()) {
    scale_.fill_(options_.init_scale);
    growth_tracker_.fill_(init_growth_tracker_);
    hysteresis_left_.fill_(init_hysteresis_left_);
    skipped_.fill_(init_skipped_);
  }
}

}  // namespace gpuops::amp
