// gpuops::optim::AdamW: torch::optim glue over the fused Adam step (fused_adam.cpp).
#include <map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>

#include "gpuops/fused_adam.h"
#include "gpuops/optimizers.h"
#include "options_archive.h"

namespace gpuops::optim {
namespace {

AdamOptions step_options_of(const AdamWOptions& o) {
  AdamOptions step_options;
  step_options.lr = o.lr();
  std::tie(step_options.beta1, step_options.beta2) = o.betas();
  step_options.eps = o.eps();
  step_options.weight_decay = o.weight_decay();
  step_options.decoupled = true;
  step_options.amsgrad = o.amsgrad();
  step_options.maximize = o.maximize();
  return step_options;
}

void check(const AdamWOptions& o, const std::string& where) { check_adam_options(step_options_of(o), where); }

constexpr const char* kWho = "an AdamW";

// Options of an archive saved by our AdamW or torch::optim::AdamW (which has no maximize and capturable).
AdamWOptions read_options(detail::Entry& e) {
  AdamWOptions o(e.number(e.required("lr", kWho), "lr"));
  const c10::IValue betas = e.required("betas", kWho);
  TORCH_CHECK_VALUE(betas.isTuple() && betas.toTupleRef().elements().size() == 2, e.where,
                    ": 'betas' must be a pair of numbers, got ", betas.tagKind());
  const auto& pair = betas.toTupleRef().elements();
  o.betas({e.number(pair[0], "betas"), e.number(pair[1], "betas")});
  o.eps(e.number(e.required("eps", kWho), "eps"));
  o.weight_decay(e.number(e.required("weight_decay", kWho), "weight_decay"));
  o.amsgrad(e.flag(e.required("amsgrad", kWho), "amsgrad"));
  o.maximize(e.flag(e.get("maximize"), "maximize"));
  o.capturable(e.flag(e.get("capturable"), "capturable"));
  check(o, e.where);
  return o;
}

// A parameter's state from our archive or torch::optim::AdamW's (an int64 step, no master copy).
std::unique_ptr<torch::optim::OptimizerParamState> read_state(detail::Entry& e, const at::Tensor& param) {
  auto step = e.step(param);
  auto exp_avg = e.tensor_like("exp_avg", param);
  auto exp_avg_sq = e.tensor_like("exp_avg_sq", param);
  TORCH_CHECK_VALUE(step && exp_avg && exp_avg_sq, e.where, ": an AdamW state needs 'step', 'exp_avg' and "
                    "'exp_avg_sq'");
  auto s = std::make_unique<AdamWParamState>();
  s->step(*step);
  s->exp_avg(*exp_avg);
  s->exp_avg_sq(*exp_avg_sq);
  if (auto max_exp_avg_sq = e.tensor_like("max_exp_avg_sq", param)) s->max_exp_avg_sq(*max_exp_avg_sq);
  if (param.scalar_type() != at::kFloat) {  // a float32 parameter steps without one
    if (auto master = e.tensor_like("master_param", param)) s->master_param(*master);
  }
  return s;
}

}  // namespace

AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}

void AdamWOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(capturable);
}

void AdamWOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  detail::read_capturable(archive, *this);
}

void AdamWParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
}

void AdamWParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, max_exp_avg_sq);
}

AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamWOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<AdamWOptions>(defaults)) {
  check(defaults, name());
  for (size_t i = 0; i < param_groups_.size(); ++i) check_options(i);
  check_unique_params();
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions defaults)
    : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const char* AdamW::name() const { return "AdamW"; }

void AdamW::check_options(size_t index) const {
  check(group_options<AdamWOptions>(index),
        std::string(name()) + ": param_groups[" + std::to_string(index) + "]");
}

void AdamW::step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  const auto& o = group_options<AdamWOptions>(index);
  AdamOptions step_options = step_options_of(o);
  if (o.capturable()) step_options.lr_tensor = o.device_lr.on(params[0].device(), o.lr());
  // One fused call per parameter dtype: float32 directly, float16/bfloat16 on their fp32 master copies.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : params) by_dtype[p.scalar_type()].push_back(p);
  for (auto& [dtype, group] : by_dtype) {
    const bool master = dtype != at::kFloat;
    std::vector<at::Tensor> grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
    for (const at::Tensor& p : group) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<AdamWParamState>();
        fresh->step(at::zeros({}, p.options().dtype(at::kFloat)));
        fresh->exp_avg(at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& s = static_cast<AdamWParamState&>(*slot);
      if (master) s.master_param(synced_master(p, s.master_param()));
      const at::Tensor& like = master ? s.master_param() : p;
      if (o.amsgrad() && !s.max_exp_avg_sq().defined())
        s.max_exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
      grads.push_back(p.grad());
      if (master) masters.push_back(s.master_param());
      exp_avgs.push_back(s.exp_avg());
      exp_avg_sqs.push_back(s.exp_avg_sq());
      if (o.amsgrad()) max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      steps.push_back(s.step());
    }
    if (master) {
      adam_step_master_(group, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, step_options, grad_scale,
                        found_inf);
    } else {
      adam_step_(group, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, step_options, grad_scale, found_inf);
    }
  }
}

void AdamW::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
}

void AdamW::load(torch::serialize::InputArchive& archive) {
  detail::load_checked<AdamWOptions>(*this, archive, "AdamW.load", read_options, read_state);
  forget_master_versions();
}

}  // namespace gpuops::optim
