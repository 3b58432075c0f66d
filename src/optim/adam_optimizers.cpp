// gpuops::optim::Adam and AdamW: torch::optim glue over the fused Adam step (fused_adam.cpp). Their options
// have the same fields (only the weight decay's kind and default differ): one template serves both.
#include <map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>

#include "gpuops/fused_adam.h"
#include "gpuops/fused_adam8.h"
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
  TORCH_CHECK_VALUE(o.state_bits() == 32 || o.state_bits() == 8, where, ": state_bits must be 32 (float32 moments) "
                    "or 8 (block-wise 8-bit moments), got ", o.state_bits());
  TORCH_CHECK_VALUE(!(o.state_bits() == 8 && o.amsgrad()), where, ": amsgrad=true is not supported with "
                    "state_bits=8 (its running maximum would be a third state); use state_bits=32 for amsgrad");
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
  if (auto bits = e.get("state_bits")) o.state_bits(static_cast<int64_t>(e.number(*bits, "state_bits")));
  check(o, e.where);
  return o;
}

// The 8-bit moments of an archive (codes and scales of our state_format) into `s`, on the parameter's device:
// as saved when laid out as the parameter, else decoded into float32 (encoded in our layout at the next step:
// blocks run over memory order, so an element-wise copy would mix them).
void read_8bit_moments(detail::Entry& e, AdamWParamState& s, const at::Tensor& param) {
  const auto format = e.get("state_format");
  TORCH_CHECK_VALUE(format && format->isString() && format->toStringRef() == kStateFormat, e.where,
                    ": 'state_format' must be '", kStateFormat, "' (other code books would decode to wrong values), "
                    "got ", format ? (format->isString() ? format->toStringRef() : format->tagKind()) : "none");
  at::Tensor codes[2], scales[2];  // exp_avg's, then exp_avg_sq's
  for (const int k : {0, 1}) {
    const std::string name = k == 0 ? "exp_avg" : "exp_avg_sq";
    const auto tensor = [&](const std::string& key) {
      auto v = e.get(key.c_str());
      TORCH_CHECK_VALUE(v && v->isTensor(), e.where, ": an 8-bit state needs '", key, "'");
      return v->toTensor();
    };
    codes[k] = tensor(name + "_codes");
    scales[k] = tensor(name + "_scales");
    TORCH_CHECK_VALUE(codes[k].scalar_type() == at::kByte && codes[k].sizes() == param.sizes() &&
                          codes[k].is_non_overlapping_and_dense(),
                      e.where, ": '", name, "_codes' must be dense uint8 of the parameter's shape ", param.sizes(),
                      ", got ", codes[k].toString(), " ", codes[k].sizes());
    TORCH_CHECK_VALUE(scales[k].scalar_type() == at::kFloat && scales[k].dim() == 1 &&
                          scales[k].numel() == state_blocks(param.numel()),
                      e.where, ": '", name, "_scales' must be float32 with ", state_blocks(param.numel()),
                      " elements (one per ", kStateBlock, "), got ", scales[k].toString(), " ", scales[k].sizes());
    TORCH_CHECK_VALUE(!(scales[k] < 0).any().item<bool>(), e.where, ": '", name, "_scales' has negative scales (a "
                      "scale is its block's largest magnitude, >= 0): not a state this optimizer wrote");
  }
  const auto moved = [&](const at::Tensor& t) { return t.to(param.device(), /*non_blocking=*/false, /*copy=*/true); };
  if (codes[0].strides() == param.strides() && codes[1].strides() == param.strides()) {
    s.exp_avg_codes(moved(codes[0]));
    s.exp_avg_scales(moved(scales[0]).contiguous());
    s.exp_avg_sq_codes(moved(codes[1]));
    s.exp_avg_sq_scales(moved(scales[1]).contiguous());
    return;
  }
  const auto decoded = [&](int k) {
    return at::empty_like(param, param.options().dtype(at::kFloat))
        .copy_(dequantize_state(codes[k], scales[k].contiguous(), k == 0));
  };
  s.exp_avg(decoded(0));
  s.exp_avg_sq(decoded(1));
}

// A parameter's state from our archive or torch::optim's (an int64 step, no master copy).
std::unique_ptr<torch::optim::OptimizerParamState> read_state(detail::Entry& e, const at::Tensor& param) {
  auto step = e.step(param);
  auto exp_avg = e.tensor_like("exp_avg", param);
  auto exp_avg_sq = e.tensor_like("exp_avg_sq", param);
  auto s = std::make_unique<AdamWParamState>();
  if (!exp_avg && !exp_avg_sq && e.get("exp_avg_codes")) {
    read_8bit_moments(e, *s, param);
  } else {
    TORCH_CHECK_VALUE(exp_avg && exp_avg_sq, e.where, ": an Adam/AdamW state needs 'step', 'exp_avg' and "
                      "'exp_avg_sq' (or their 8-bit codes and scales)");
    s->exp_avg(*exp_avg);
    s->exp_avg_sq(*exp_avg_sq);
  }
  TORCH_CHECK_VALUE(step, e.where, ": an Adam/AdamW state needs 'step'");
  s->step(*step);
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
  archive.write("state_bits", c10::IValue(o.state_bits()));
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
  if (archive.try_read("state_bits", v)) o.state_bits(v.toInt());
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
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_codes);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_scales);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_codes);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_scales);
  if (exp_avg_codes().defined()) archive.write("state_format", c10::IValue(std::string(kStateFormat)));
}

void AdamWParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_codes);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_scales);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq_codes);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq_scales);
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

int64_t AdamW::state_bits(size_t index) const { return group_options<AdamWOptions>(index).state_bits(); }

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

int64_t Adam::state_bits(size_t index) const { return group_options<AdamOptions>(index).state_bits(); }

AdamStepOptions Adam::step_options(size_t index, c10::Device device) const {
  return step_options_of(group_options<AdamOptions>(index), /*decoupled=*/false, device);
}

namespace {

// 8-bit moments laid out as `like`, encoded from float32 ones when the state has them (a loaded 32-bit state, a
// group switched to state_bits 8), else from zeros.
void to_8bit(AdamWParamState& s, const at::Tensor& like) {
  if (s.exp_avg_codes().defined()) return;
  for (const bool is_signed : {true, false}) {
    at::Tensor values = is_signed ? s.exp_avg() : s.exp_avg_sq();
    const at::Tensor laid_out = at::empty_like(like, like.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
    if (!values.defined()) {
      values = laid_out.zero_();
    } else if (values.strides() != like.strides()) {
      values = laid_out.copy_(values);
    }
    at::Tensor codes = at::empty_like(like, like.options().dtype(at::kByte), at::MemoryFormat::Preserve);
    at::Tensor scales = at::empty({state_blocks(like.numel())}, like.options().dtype(at::kFloat));
    quantize_state_(values, codes, scales, is_signed);
    if (is_signed) {
      s.exp_avg_codes(codes);
      s.exp_avg_scales(scales);
    } else {
      s.exp_avg_sq_codes(codes);
      s.exp_avg_sq_scales(scales);
    }
  }
  s.exp_avg(at::Tensor());
  s.exp_avg_sq(at::Tensor());
}

// Float32 moments again in place of 8-bit ones (the group's state_bits is 32 now).
void to_32bit(AdamWParamState& s) {
  if (!s.exp_avg_codes().defined()) return;
  s.exp_avg(dequantize_state(s.exp_avg_codes(), s.exp_avg_scales(), true));
  s.exp_avg_sq(dequantize_state(s.exp_avg_sq_codes(), s.exp_avg_sq_scales(), false));
  s.exp_avg_codes(at::Tensor());
  s.exp_avg_scales(at::Tensor());
  s.exp_avg_sq_codes(at::Tensor());
  s.exp_avg_sq_scales(at::Tensor());
}

}  // namespace

void AdamBase::step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  const AdamStepOptions step_options = this->step_options(index, params[0].device());
  const bool eight_bit_group = state_bits(index) == 8;
  // One fused call per parameter dtype and state width: float32 directly, float16/bfloat16 on their fp32 master
  // copies; 8-bit moments for parameters of kMin8BitNumel elements or more in a state_bits 8 group.
  std::map<std::pair<at::ScalarType, bool>, std::vector<at::Tensor>> by_kind;
  for (const at::Tensor& p : params)
    by_kind[{p.scalar_type(), eight_bit_group && takes_8bit_states(p)}].push_back(p);
  for (auto& [kind, group] : by_kind) {
    const auto [dtype, eight] = kind;
    const bool master = dtype != at::kFloat;
    // (8-bit: exp_avgs and exp_avg_sqs hold the codes; the scales go beside them)
    std::vector<at::Tensor> ps, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, m_scales, v_scales;
    for (const at::Tensor& p : group) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<AdamWParamState>();
        fresh->step(fresh_step(p));
        slot = std::move(fresh);
      }
      auto& s = static_cast<AdamWParamState&>(*slot);
      if (master) s.master_param(synced_master(p, s.master_param()));
      const at::Tensor& like = master ? s.master_param() : p;
      if (eight) {
        to_8bit(s, like);
      } else {
        to_32bit(s);
        const auto zeros = [&] {
          return at::zeros_like(like, like.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
        };
        if (!s.exp_avg().defined()) s.exp_avg(zeros());
        if (!s.exp_avg_sq().defined()) s.exp_avg_sq(zeros());
      }
      if (step_options.amsgrad && !s.max_exp_avg_sq().defined())
        s.max_exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
      for (const StepPart& part : step_parts(p, s.step())) {
        // A part's blocks are the state's own: it starts on a block (ZeroShards lays its buffers out so).
        TORCH_CHECK(!eight || part.offset % kStateBlock == 0, name(), ": an 8-bit part starts at element ",
                    part.offset, ", inside a block of ", kStateBlock);
        ps.push_back(part_of(p, part));
        grads.push_back(part_of(p.grad(), part));
        if (master) masters.push_back(part_of(s.master_param(), part));
        exp_avgs.push_back(part_of(eight ? s.exp_avg_codes() : s.exp_avg(), part));
        exp_avg_sqs.push_back(part_of(eight ? s.exp_avg_sq_codes() : s.exp_avg_sq(), part));
        if (eight) {
          const auto blocks_of = [&](const at::Tensor& scales) {
            return scales.narrow(0, part.offset / kStateBlock, state_blocks(part.numel));
          };
          m_scales.push_back(blocks_of(s.exp_avg_scales()));
          v_scales.push_back(blocks_of(s.exp_avg_sq_scales()));
        }
        if (step_options.amsgrad) max_exp_avg_sqs.push_back(part_of(s.max_exp_avg_sq(), part));
        steps.push_back(part.step);
      }
    }
    if (ps.empty()) continue;  // every part left out (a sharded optimizer's parameters without gradients)
    if (eight) {
      adam8_step_(ps, grads, masters, exp_avgs, m_scales, exp_avg_sqs, v_scales, steps, step_options, grad_scale,
                  found_inf);
    } else if (master) {
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
