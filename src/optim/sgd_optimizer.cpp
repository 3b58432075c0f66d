// gpuops::optim::SGD: torch::optim glue over the fused SGD step (fused_sgd.cpp).
#include <map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>

#include "gpuops/fused_sgd.h"
#include "gpuops/optimizers.h"
#include "options_archive.h"

namespace gpuops::optim {
namespace {

SgdStepOptions step_options_of(const SGDOptions& o) {
  SgdStepOptions step_options;
  step_options.lr = o.lr();
  step_options.momentum = o.momentum();
  step_options.dampening = o.dampening();
  step_options.weight_decay = o.weight_decay();
  step_options.nesterov = o.nesterov();
  step_options.maximize = o.maximize();
  return step_options;
}

void check(const SGDOptions& o, const std::string& where) { check_sgd_options(step_options_of(o), where); }

constexpr const char* kWho = "an SGD";

// Options of an archive saved by our SGD or torch::optim::SGD (which has no maximize and capturable).
SGDOptions read_options(detail::Entry& e) {
  SGDOptions o(e.number(e.required("lr", kWho), "lr"));
  o.momentum(e.number(e.required("momentum", kWho), "momentum"));
  o.dampening(e.number(e.required("dampening", kWho), "dampening"));
  o.weight_decay(e.number(e.required("weight_decay", kWho), "weight_decay"));
  o.nesterov(e.flag(e.required("nesterov", kWho), "nesterov"));
  o.maximize(e.flag(e.get("maximize"), "maximize"));
  o.capturable(e.flag(e.get("capturable"), "capturable"));
  check(o, e.where);
  return o;
}

// A parameter's state from our archive or torch::optim::SGD's, which keeps no step: a loaded momentum
// buffer is continued (step 1), not restarted from the next gradient, as the Python SGD does.
std::unique_ptr<torch::optim::OptimizerParamState> read_state(detail::Entry& e, const at::Tensor& param) {
  auto buffer = e.tensor_like("momentum_buffer", param);
  auto step = e.step(param);
  auto s = std::make_unique<SGDParamState>();
  if (buffer) s->momentum_buffer(*buffer);
  s->step(step ? *step : at::full({}, buffer ? 1.0 : 0.0, param.options().dtype(at::kFloat)));
  if (param.scalar_type() != at::kFloat) {
    if (auto master = e.tensor_like("master_param", param)) s->master_param(*master);
  }
  return s;
}

}  // namespace

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(capturable);
}

void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  detail::read_capturable(archive, *this);
}

void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<SGDOptions>(defaults)) {
  check(defaults, name());
  for (size_t i = 0; i < param_groups_.size(); ++i) check_options(i);
  check_unique_params();
}

SGD::SGD(std::vector<at::Tensor> params, SGDOptions defaults)
    : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const char* SGD::name() const { return "SGD"; }

void SGD::check_options(size_t index) const {
  check(group_options<SGDOptions>(index),
        std::string(name()) + ": param_groups[" + std::to_string(index) + "]");
}

void SGD::step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  const auto& o = group_options<SGDOptions>(index);
  SgdStepOptions step_options = step_options_of(o);
  if (o.capturable()) step_options.lr_tensor = o.device_lr.on(params[0].device(), o.lr());
  // One fused call per parameter dtype: float32 directly, float16/bfloat16 on their fp32 master copies.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : params) by_dtype[p.scalar_type()].push_back(p);
  for (auto& [dtype, group] : by_dtype) {
    const bool master = dtype != at::kFloat;
    std::vector<at::Tensor> ps, grads, masters, buffers, steps;
    for (const at::Tensor& p : group) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<SGDParamState>();
        fresh->step(fresh_step(p));
        slot = std::move(fresh);
      }
      auto& s = static_cast<SGDParamState&>(*slot);
      if (master) s.master_param(synced_master(p, s.master_param()));
      if (o.momentum() != 0 && !s.momentum_buffer().defined()) {
        s.momentum_buffer(at::zeros_like(master ? s.master_param() : p, at::MemoryFormat::Preserve));
        s.step().zero_();  // a new buffer starts from the next applied gradient, as in torch
      }
      for (const StepPart& part : step_parts(p, s.step())) {
        ps.push_back(part_of(p, part));
        grads.push_back(part_of(p.grad(), part));
        if (master) masters.push_back(part_of(s.master_param(), part));
        if (o.momentum() != 0) buffers.push_back(part_of(s.momentum_buffer(), part));
        steps.push_back(part.step);
      }
    }
    if (ps.empty()) continue;  // every part left out (a sharded optimizer's parameters without gradients)
    if (master) {
      sgd_step_master_(ps, grads, masters, buffers, steps, step_options, grad_scale, found_inf);
    } else {
      sgd_step_(ps, grads, buffers, steps, step_options, grad_scale, found_inf);
    }
  }
}

void SGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
  write_kind(archive);
}

void SGD::load(torch::serialize::InputArchive& archive) {
  check_kind(archive);
  detail::load_checked<SGDOptions>(*this, archive, "SGD.load", read_options, read_state);
  forget_master_versions();
}

}  // namespace gpuops::optim
