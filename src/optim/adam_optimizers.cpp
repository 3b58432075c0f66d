// gpuops::optim::Adam and AdamW: torch::optim glue over the fused Adam step (fused_adam.cpp). Their options
// have the same fields (only the weight decay's kind and default differ): one template serves both.
#include <map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>

#include "gpuops/fused_adam.h"
#include "gpuops/optimizers.h"
#include "options_archive.h"

namespace gpuops::optim {
namespace {

// `device`: where a capturable group keeps its learning rate (the parameters' device); none for checks.
template <typename Options>
AdamStepOptions step_options_of(const Options& o, bool decoupled, std::optional<c10::Device> device = {}) {
  AdamStepOptions step_options;
  step_options.lr = o.lr();
  std::tie(step_options.beta1, step_options.beta2) = o.betas();
  step_options.eps = o.eps();
  step_options.weight_decay = o.weight_decay();
  step_options.decoupled = decoupled;
  step_options.amsgrad = o.amsgrad();
  step_options.maximize = o.maximize();
  if (device && o.capturable()) step_options.lr_tensor = o.device_lr.on(*device, o.lr());
  return step_options;
}

template <typename Options>
void check(const Options& o, const std::string& where) {
  check_adam_options(step_options_of(o, true), where);
}

// Options of an archive saved by our Adam/AdamW or torch::optim's (which have no maximize and capturable).
template <typename Options>
Options read_options(detail::Entry& e, const char* who) {
  Options o(e.number(e.required("lr", who), "lr"));
  const c10::IValue betas = e.required("betas", who);
  TORCH_CHECK_VALUE(betas.isTuple() && betas.toTupleRef().elements().size() == 2, e.where,
                    ": 'betas' must be a pair of numbers, got ", betas.tagKind());
  const auto& pair = betas.toTupleRef().elements();
  o.betas({e.number(pair[0], "betas"), e.number(pair[1], "betas")});
  o.eps(e.number(e.required("eps", who), "eps"));
  o.weight_decay(e.number(e.required("weight_decay", who), "weight_decay"));
  o.amsgrad(e.flag(e.required("amsgrad", who), "amsgrad"));
  o.maximize(e.flag(e.get("maximize"), "maximize"));
  o.capturable(e.flag(e.get("capturable"), "capturable"));
  check(o, e.where);
  return o;
}

// A parameter's state from our archive or torch::optim's (an int64 step, no master copy).
std::unique_ptr<torch::optim::OptimizerParamState> read_state(detail::Entry& e, const at::Tensor& param) {
  auto step = e.step(param);
  auto exp_avg = e.tensor_like("exp_avg", param);
  auto exp_avg_sq = e.tensor_like("exp_avg_sq", param);
  TORCH_CHECK_VALUE(step && exp_avg && exp_avg_sq, e.where, ": an Adam/AdamW state needs 'step', 'exp_avg' and "
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

template <typename Options>
void write_options(const Options& o, torch::serialize::OutputArchive& archive) {
  archive.write("lr", c10::IValue(o.lr()));
  archive.write("betas", c10::IValue(o.betas()));
  archive.write("eps", c10::IValue(o.eps()));
  archive.write("weight_decay", c10::IValue(o.weight_decay()));
  archive.write("amsgrad", c10::IValue(o.amsgrad()));
  archive.write("maximize", c10::IValue(o.maximize()));
  archive.write("capturable", c10::IValue(o.capturable()));
}

template <typename Options>
void read_archive_options(Options& o, torch::serialize::InputArchive& archive) {
  c10::IValue v;
  archive.read("lr", v);
  o.lr(v.toDouble());
  archive.read("betas", v);
  o.betas(v.to<std::tuple<double, double>>());
  archive.read("eps", v);
  o.eps(v.toDouble());
  archive.read("weight_decay", v);
  o.weight_decay(v.toDouble());
  archive.read("amsgrad", v);
  o.amsgrad(v.toBool());
  archive.read("maximize", v);
  o.maximize(v.toBool());
  detail::read_capturable(archive, o);
}

}  // namespace

AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}
void AdamWOptions::serialize(torch::serialize::OutputArchive& archive) const { write_options(*this, archive); }
void AdamWOptions::serialize(torch::serialize::InputArchive& archive) { read_archive_options(*this, archive); }

AdamOptions::AdamOptions(double lr) : lr_(lr) {}
void AdamOptions::serialize(torch::serialize::OutputArchive& archive) const { write_options(*this, archive); }
void AdamOptions::serialize(torch::serialize::InputArchive& archive) { read_archive_options(*this, archive); }

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
    : AdamBase(param_groups, std::make_unique<AdamWOptions>(defaults)) {
  check(defaults, name());
  for (size_t i = 0; i < param_groups_.size(); ++i) check_options(i);
  check_unique_params();
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions defaults)
    : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const char* AdamW::name() const { return "AdamW"; }

void AdamW::check_options(size_t index) const {
  check(group_options<AdamWOptions>(index), std::string(name()) + ": param_groups[" + std::to_string(index) + "]");
}

AdamStepOptions AdamW::step_options(size_t index, c10::Device device) const {
  return step_options_of(group_options<AdamWOptions>(index), /*decoupled=*/true, device);
}

Adam::Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamOptions defaults)
    : AdamBase(param_groups, std::make_unique<AdamOptions>(defaults)) {
  check(defaults, name());
  for (size_t i = 0; i < param_groups_.size(); ++i) check_options(i);
  check_unique_params();
}

Adam::Adam(std::vector<at::Tensor> params, AdamOptions defaults)
    : Adam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const char* Adam::name() const { return "Adam"; }

void Adam::check_options(size_t index) const {
  check(group_options<AdamOptions>(index), std::string(name()) + ": param_groups[" + std::to_string(index) + "]");
}

AdamStepOptions Adam::step_options(size_t index, c10::Device device) const {
  return step_options_of(group_options<AdamOptions>(index), /*decoupled=*/false, device);
}

void AdamBase::step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  const AdamStepOptions step_options = this->step_options(index, params[0].device());
  // One fused call per parameter dtype: float32 directly, float16/bfloat16 on their fp32 master copies.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : params) by_dtype[p.scalar_type()].push_back(p);
  for (auto& [dtype, group] : by_dtype) {
    const bool master = dtype != at::kFloat;
    std::vector<at::Tensor> ps, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
    for (const at::Tensor& p : group) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<AdamWParamState>();
        fresh->step(fresh_step(p));
        fresh->exp_avg(at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& s = static_cast<AdamWParamState&>(*slot);
      if (master) s.master_param(synced_master(p, s.master_param()));
      const at::Tensor& like = master ? s.master_param() : p;
      if (step_options.amsgrad && !s.max_exp_avg_sq().defined())
        s.max_exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
      for (const StepPart& part : step_parts(p, s.step())) {
        ps.push_back(part_of(p, part));
        grads.push_back(part_of(p.grad(), part));
        if (master) masters.push_back(part_of(s.master_param(), part));
        exp_avgs.push_back(part_of(s.exp_avg(), part));
        exp_avg_sqs.push_back(part_of(s.exp_avg_sq(), part));
        if (step_options.amsgrad) max_exp_avg_sqs.push_back(part_of(s.max_exp_avg_sq(), part));
        steps.push_back(part.step);
      }
    }
    if (ps.empty()) continue;  // every part left out (a sharded optimizer's parameters without gradients)
    if (master) {
      adam_step_master_(ps, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, step_options, grad_scale,
                        found_inf);
    } else {
      adam_step_(ps, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, step_options, grad_scale, found_inf);
    }
  }
}

void AdamW::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
  write_kind(archive);
}

void AdamW::load(torch::serialize::InputArchive& archive) {
  check_kind(archive);
  detail::load_checked<AdamWOptions>(
      *this, archive, "AdamW.load", [](detail::Entry& e) { return read_options<AdamWOptions>(e, "an AdamW"); },
      read_state);
  forget_master_versions();
}

void Adam::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamParamState, AdamOptions>(archive, *this);
  write_kind(archive);
}

void Adam::load(torch::serialize::InputArchive& archive) {
  check_kind(archive);
  detail::load_checked<AdamOptions>(
      *this, archive, "Adam.load", [](detail::Entry& e) { return read_options<AdamOptions>(e, "an Adam"); },
      read_state);
  forget_master_versions();
}

}  // namespace gpuops::optim
