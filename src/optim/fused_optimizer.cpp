// The torch::optim::Optimizer side of the fused optimizers: closure, per-group gathering, checks before
// anything changes.
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "gpuops/fused_adam8.h"
#include "gpuops/optimizers.h"

namespace gpuops::optim {

const at::Tensor& DeviceLr::on(const at::Device& device, double lr) const {
  if (!tensor_.defined() || tensor_.device() != device) {
    tensor_ = at::full({1}, lr, at::TensorOptions().dtype(at::kFloat).device(device));
  } else if (value_ != lr) {
    tensor_.fill_(lr);
  }
  value_ = lr;
  return tensor_;
}

void DeviceLr::set(double lr) {
  if (!tensor_.defined()) return;
  tensor_.fill_(lr);
  value_ = lr;
}

at::Tensor FusedOptimizer::synced_master(const at::Tensor& param, const at::Tensor& master) {
  const c10::TensorImpl* key = param.unsafeGetTensorImpl();
  const auto seen = master_versions_.find(key);
  const bool written = seen == master_versions_.end() || seen->second != param._version();
  at::Tensor result = master;
  if (!master.defined() || (written && !at::equal(master.to(param.scalar_type()), param))) {
    result = param.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
  master_versions_[key] = param._version();
  return result;
}

bool FusedOptimizer::takes_8bit_states(const at::Tensor& param) const { return param.numel() >= kMin8BitNumel; }

at::Tensor FusedOptimizer::fresh_step(const at::Tensor& param) const {
  return at::zeros({}, param.options().dtype(at::kFloat));
}

at::Tensor FusedOptimizer::part_of(const at::Tensor& t, const StepPart& part) {
  if (part.offset == 0 && part.numel == t.numel()) return t;
  return t.view({-1}).narrow(0, part.offset, part.numel);
}

void FusedOptimizer::check_unique_params() const {
  std::unordered_map<const c10::TensorImpl*, size_t> group_of;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    for (const at::Tensor& p : param_groups_[i].params()) {
      const auto [seen, fresh] = group_of.emplace(p.unsafeGetTensorImpl(), i);
      TORCH_CHECK_VALUE(fresh, name(), ": a parameter of shape ", p.sizes(), " is listed twice (in param_groups[",
                        seen->second, "] and param_groups[", i, "]); it would be stepped twice: give each "
                        "parameter once");
    }
  }
}

at::Tensor FusedOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step_scaled(std::nullopt, std::nullopt);
  return loss;
}

void FusedOptimizer::step_scaled(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  c10::NoGradGuard no_grad;
  // Check every group first: a failed step leaves every parameter and state as it was.
  for (const auto& [what, t] : {std::make_pair("grad_scale", &grad_scale), std::make_pair("found_inf", &found_inf)}) {
    TORCH_CHECK_VALUE(!*t || ((*t)->defined() && (*t)->numel() == 1 && (*t)->scalar_type() == at::kFloat), name(),
                      ".step_scaled: ", what, " must be a one-element float32 tensor, got ",
                      !*t || !(*t)->defined() ? std::string("an undefined tensor")
                                              : (*t)->toString() + " of shape " + c10::str((*t)->sizes()));
  }
  check_unique_params();
  std::vector<std::vector<at::Tensor>> with_grad(param_groups_.size());
  std::vector<std::optional<c10::Device>> devices(param_groups_.size());
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    check_options(i);
    std::optional<c10::Device> device;
    for (const at::Tensor& p : param_groups_[i].params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK_VALUE(g.layout() == c10::kStrided, name(), ": param_groups[", i,
                        "] has a sparse gradient; use a dense one (e.g. Embedding without sparse=true)");
      const auto dtype = p.scalar_type();
      TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) &&
                            g.scalar_type() == dtype,
                        name(), ": param_groups[", i, "] has a ", dtype, " parameter with a ", g.scalar_type(),
                        " gradient; accepted: float32, float16 or bfloat16 parameters (16-bit ones step on an "
                        "fp32 master copy) with gradients of their dtype");
      TORCH_CHECK_VALUE(!device || *device == p.device(), name(), ": param_groups[", i,
                        "] has parameters on several devices (", *device, ", ", p.device(),
                        "); give each device's parameters their own optimizer");
      // Checked here, not in the step of group i, which would come after groups 0..i-1 were stepped. Layouts
      // the fused step cannot read linearly are staged below.
      TORCH_CHECK_VALUE(g.sizes() == p.sizes(), name(), ": param_groups[", i, "] has a parameter of sizes ",
                        p.sizes(), " whose gradient has sizes ", g.sizes());
      device = p.device();
      with_grad[i].push_back(p);
    }
    devices[i] = device;
  }
  // The scaler's tensors go to each group's device (non-blocking: no sync).
  const auto on = [](const std::optional<at::Tensor>& t, c10::Device d) -> std::optional<at::Tensor> {
    if (!t) return std::nullopt;
    return t->to(d, /*non_blocking=*/true);
  };
  Staging staging;
  for (auto& group : with_grad)
    for (at::Tensor& p : group) staging.stage(p);
  try {
    for (size_t i = 0; i < with_grad.size(); ++i)
      if (!with_grad[i].empty())
        step_group(i, with_grad[i], on(grad_scale, *devices[i]), on(found_inf, *devices[i]));
  } catch (...) {
    staging.restore(/*write_back=*/false);
    throw;
  }
  staging.restore(/*write_back=*/true);
}

void FusedOptimizer::Staging::stage(at::Tensor& param) {
  const at::Tensor grad = param.grad();
  if (param.is_non_overlapping_and_dense() && grad.is_non_overlapping_and_dense() &&
      grad.strides() == param.strides())
    return;  // the common case: stepped in place
  Staged s{param, param.variable_data(), grad, at::Tensor()};
  s.dense = param.is_non_overlapping_and_dense() ? s.original : s.original.contiguous();
  // The parameter keeps its identity (its state stays its own) and steps on the dense copy's data; its
  // state is created like that copy, as torch creates state for such a parameter (contiguous).
  if (!s.dense.is_same(s.original)) param.set_data(s.dense);
  if (!grad.is_non_overlapping_and_dense() || grad.strides() != s.dense.strides())
    param.mutable_grad() = at::empty_like(s.dense).copy_(grad);
  staged_.push_back(std::move(s));
}

void FusedOptimizer::Staging::restore(bool write_back) {
  for (Staged& s : staged_) {
    if (!s.dense.is_same(s.original)) {
      s.param.set_data(s.original);
      if (write_back) s.param.detach().copy_(s.dense);  // through the parameter: its version moves, as torch's
    }
    s.param.mutable_grad() = s.grad;
  }
  staged_.clear();
}

void FusedOptimizer::write_kind(torch::serialize::OutputArchive& archive) const {
  archive.write("gpuops_optimizer", c10::IValue(std::string(name())));
}

void FusedOptimizer::check_kind(torch::serialize::InputArchive& archive) const {
  c10::IValue saved;
  if (!archive.try_read("gpuops_optimizer", saved)) return;
  const std::string kind = saved.isString() ? saved.toStringRef() : std::string("another optimizer");
  const bool adams = (kind == "Adam" || kind == "AdamW") && std::string(name()).rfind("Adam", 0) == 0;
  TORCH_CHECK_VALUE(kind == name(), name(), ".load: the archive holds the state of ", kind, ", not of ", name(),
                    adams ? " (AdamW's weight decay is decoupled, Adam's is L2)" : "", ": load it into that optimizer");
}

}  // namespace gpuops::optim
