// gpuops::optim::ZeroOptimizer<Base> (zero_optimizer.h): Base (AdamW, Adam or SGD) stepping the shard
// parameters of a ZeroShards, and the translation between Base's per-parameter state objects and named
// tensors (what the checkpoint side of ZeroShards reads and writes). No element math here.
#include <type_traits>
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "gpuops/fused_adam8.h"
#include "gpuops/memory_budget.h"
#include "gpuops/zero_optimizer.h"

namespace gpuops::optim {
namespace {

// Base's own checks of its options (a probe over one tensor), before anything is flattened or sent.
template <class Base>
void check_options(const typename Base::Options& options) {
  TORCH_CHECK_VALUE(!options.capturable(), "ZeroOptimizer: capturable=true is not supported (the step "
                    "communicates); leave it false");
  Base probe({at::zeros({1}).requires_grad_(true)}, options);  // c10::ValueError naming the option
}

// The optimizer state's bytes per parameter element (offload's host-memory check): Adam's two fp32 moments (8-bit:
// a byte each and two fp32 scales per 256; amsgrad a third), SGD's momentum buffer when it has one.
template <class Base>
double state_bytes_per_element(const typename Base::Options& options) {
  if constexpr (std::is_same_v<typename Base::Options, SGDOptions>) {
    return options.momentum() != 0 ? 4 : 0;
  } else {
    return options.state_bits() == 8 ? 2 + 8.0 / kStateBlock : options.amsgrad() ? 12 : 8;
  }
}

// 8-bit moments: the buffers of the parameters that keep them are laid out in whole blocks.
template <class Base>
StateBlocks state_blocks_of(const typename Base::Options& options) {
  if constexpr (std::is_same_v<typename Base::Options, SGDOptions>) {
    return {};
  } else {
    return options.state_bits() == 8 ? StateBlocks{kStateBlock, kMin8BitNumel} : StateBlocks{};
  }
}

// The options as every rank must pass them (shortest round-trip decimals: equal text, equal values).
template <class Options>
std::string describe_adam(const char* kind, const Options& o) {
  return fmt::format("{}(lr={}, betas=({}, {}), eps={}, weight_decay={}, amsgrad={}, maximize={}, state_bits={})",
                     kind, o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                     o.amsgrad(), o.maximize(), o.state_bits());
}
std::string describe(const AdamWOptions& o) { return describe_adam("AdamW", o); }
std::string describe(const AdamOptions& o) { return describe_adam("Adam", o); }
std::string describe(const SGDOptions& o) {
  return fmt::format("SGD(lr={}, momentum={}, dampening={}, weight_decay={}, nesterov={}, maximize={})", o.lr(),
                     o.momentum(), o.dampening(), o.weight_decay(), o.nesterov(), o.maximize());
}

// The optimizer's part of the construction's agreement: its checks on this rank, and its kind and options.
template <class Base>
dist::Agreement construction_agreement(const typename Base::Options& options) {
  dist::Agreement agreement("ZeroOptimizer");
  agreement.check([&] { check_options<Base>(options); });
  agreement.field("optimizer and options", describe(options));
  return agreement;
}

void add(NamedTensors& named, const char* name, const at::Tensor& t) {
  if (t.defined()) named[name] = t;
}

NamedTensors named_of(const AdamWParamState& s) {
  NamedTensors n;
  add(n, "step", s.step());
  add(n, "exp_avg", s.exp_avg());
  add(n, "exp_avg_sq", s.exp_avg_sq());
  add(n, "max_exp_avg_sq", s.max_exp_avg_sq());
  add(n, "exp_avg_codes", s.exp_avg_codes());
  add(n, "exp_avg_scales", s.exp_avg_scales());
  add(n, "exp_avg_sq_codes", s.exp_avg_sq_codes());
  add(n, "exp_avg_sq_scales", s.exp_avg_sq_scales());
  return n;
}

NamedTensors named_of(const SGDParamState& s) {
  NamedTensors n;
  add(n, "step", s.step());
  add(n, "momentum_buffer", s.momentum_buffer());
  return n;
}

// A state tensor checked against its shard parameter: element-wise (the shard's length; 8-bit codes: uint8),
// one per block of an 8-bit state (its scales), or the step counters (one per parameter of the buffer,
// `counters`; a single one, as files before per-parameter counters hold, is every parameter's). Counters are
// finite whole numbers >= 0: a crafted -3 or inf would poison the bias corrections.
at::Tensor take(const NamedTensors& named, const std::string& name, const at::Tensor& shard, bool required, size_t k,
                int64_t counters) {
  const auto found = named.find(name);
  TORCH_CHECK_VALUE(found != named.end() || !required, "ZeroOptimizer: the state of flat buffer ", k,
                    " has no '", name, "'");
  if (found == named.end()) return at::Tensor();
  const at::Tensor& t = found->second;
  const bool step = name == "step", codes = is_state_codes(name), scales = is_state_scales(name);
  const int64_t numel = step ? counters : scales ? shard.numel() / kStateBlock : shard.numel();
  const bool sized = t.defined() && (t.numel() == numel || (step && t.numel() == 1));
  const bool typed = t.defined() && (codes ? t.scalar_type() == at::kByte : t.is_floating_point());
  TORCH_CHECK_VALUE(sized && typed, "ZeroOptimizer: '", name, "' of flat buffer ", k, " must be a ",
                    codes ? "uint8" : "floating", " tensor of ", numel, " elements", step ? " (or one)" : "",
                    ", got ", t.defined() ? t.toString() : "none", " of shape ", t.defined() ? c10::str(t.sizes()) : "[]");
  TORCH_CHECK_VALUE(!scales || !(t < 0).any().item<bool>(), "ZeroOptimizer: '", name, "' of flat buffer ", k,
                    " has negative scales (a scale is its block's largest magnitude, >= 0)");
  c10::NoGradGuard no_grad;
  if (step) {
    const at::Tensor values = t.detach().to(at::kCPU, at::kDouble).reshape({-1});
    TORCH_CHECK_VALUE(values.isfinite().all().item<bool>() && values.ge(0).all().item<bool>() &&
                          values.eq(values.floor()).all().item<bool>(),
                      "ZeroOptimizer: 'step' of flat buffer ", k, " must hold whole numbers >= 0 (steps taken), got ",
                      values.min().item<double>(), " .. ", values.max().item<double>());
    return t.detach().to(shard.options().requires_grad(false)).reshape({-1}).expand({counters}).contiguous();
  }
  at::Tensor out = at::empty({numel}, shard.options().dtype(codes ? at::kByte : at::kFloat).requires_grad(false));
  return out.copy_(t.reshape(out.sizes()));
}

std::unique_ptr<AdamWParamState> state_from(const NamedTensors& named, const at::Tensor& shard, size_t k,
                                            int64_t counters, const AdamWParamState*) {
  auto s = std::make_unique<AdamWParamState>();
  s->step(take(named, "step", shard, true, k, counters));
  s->max_exp_avg_sq(take(named, "max_exp_avg_sq", shard, false, k, counters));
  if (named.count("exp_avg_codes") == 0) {
    s->exp_avg(take(named, "exp_avg", shard, true, k, counters));
    s->exp_avg_sq(take(named, "exp_avg_sq", shard, true, k, counters));
    return s;
  }
  // 8-bit moments: a shard of a buffer laid out in whole blocks (ZeroShards::shard_states_of decodes the others).
  TORCH_CHECK_VALUE(shard.numel() % kStateBlock == 0, "ZeroOptimizer: flat buffer ", k, " holds 8-bit moments but "
                    "its shard is not a whole number of ", kStateBlock, "-element blocks (a damaged or crafted file)");
  s->exp_avg_codes(take(named, "exp_avg_codes", shard, true, k, counters));
  s->exp_avg_scales(take(named, "exp_avg_scales", shard, true, k, counters));
  s->exp_avg_sq_codes(take(named, "exp_avg_sq_codes", shard, true, k, counters));
  s->exp_avg_sq_scales(take(named, "exp_avg_sq_scales", shard, true, k, counters));
  return s;
}

std::unique_ptr<SGDParamState> state_from(const NamedTensors& named, const at::Tensor& shard, size_t k,
                                          int64_t counters, const SGDParamState*) {
  auto s = std::make_unique<SGDParamState>();
  s->momentum_buffer(take(named, "momentum_buffer", shard, false, k, counters));
  at::Tensor step = take(named, "step", shard, false, k, counters);
  // torch's SGD keeps no step: a loaded buffer is continued, as SGD::load does.
  s->step(step.defined() ? step : at::full({counters}, s->momentum_buffer().defined() ? 1.0 : 0.0,
                                           shard.options().requires_grad(false)));
  return s;
}

// A full state's 8-bit moments kept where they land in a buffer laid out in blocks whose every parameter with a
// state has them; decoded into float32 elsewhere (a state of state_bits 8 loaded at 32, or mixed with a torch
// state): the step encodes those again in the buffer's own blocks.
std::vector<NamedTensors> with_8bit_where_laid_out(std::vector<NamedTensors> per_param, const ZeroShards& z) {
  std::vector<char> keep(z.bucket_count(), 1);
  for (size_t i = 0; i < per_param.size() && i < z.param_count(); ++i) {
    const size_t k = z.bucket_of_param(i);
    if (!per_param[i].empty() && (!z.blocked(k) || per_param[i].count("exp_avg_codes") == 0)) keep[k] = 0;
  }
  for (size_t i = 0; i < per_param.size() && i < z.param_count(); ++i) {
    NamedTensors& state = per_param[i];
    if (keep[z.bucket_of_param(i)] || state.count("exp_avg_codes") == 0) continue;
    for (const std::string moment : {"exp_avg", "exp_avg_sq"}) {
      const auto codes = state.find(moment + "_codes"), scales = state.find(moment + "_scales");
      TORCH_CHECK_VALUE(codes != state.end() && scales != state.end(), "ZeroOptimizer.load_state_dict: state[", i,
                        "] has 8-bit moments without '", moment, "_codes' and '", moment, "_scales'");
      state[moment] = dequantize_state(codes->second, scales->second.contiguous(), moment == "exp_avg");
      state.erase(moment + "_codes");
      state.erase(moment + "_scales");
    }
  }
  return per_param;
}

}  // namespace

namespace {
ZeroOptions stage_only(int stage) {
  ZeroOptions o;
  o.stage = stage;
  return o;
}
}  // namespace

template <class Base>
ZeroOptimizer<Base>::ZeroOptimizer(std::vector<at::Tensor> params, dist::Communicator communicator, ZeroOptions zero,
                                   Options options)
    : detail::ZeroShardsHolder{ZeroShards(params, std::move(communicator), zero, construction_agreement<Base>(options),
                                          state_blocks_of<Base>(options), state_bytes_per_element<Base>(options))},
      Base(zero_shards.shard_params(), options) {}

template <class Base>
ZeroOptimizer<Base>::ZeroOptimizer(std::vector<at::Tensor> params, dist::Communicator communicator, int stage,
                                   Options options)
    : ZeroOptimizer(std::move(params), std::move(communicator), stage_only(stage), std::move(options)) {}

template <class Base>
void ZeroOptimizer<Base>::add_param_group(const torch::optim::OptimizerParamGroup& /*param_group*/) {
  TORCH_CHECK_VALUE(false, "ZeroOptimizer: add_param_group is not supported (one group over the flat buffers); make "
                    "another ZeroOptimizer for parameters with other options");
}

template <class Base>
void ZeroOptimizer<Base>::zero_grad(bool set_to_none) {
  zero_shards.zero_grad(set_to_none);
}

template <class Base>
at::Tensor ZeroOptimizer<Base>::fresh_step(const at::Tensor& shard) const {
  const auto counters = static_cast<int64_t>(zero_shards.bucket(zero_shards.shard_index(shard)).slots.size());
  return at::zeros({counters}, shard.options().dtype(at::kFloat).requires_grad(false));
}

template <class Base>
bool ZeroOptimizer<Base>::takes_8bit_states(const at::Tensor& shard) const {
  // The layout is made at construction: a group switched to state_bits 8 later has no blocked buffers.
  TORCH_CHECK_VALUE(zero_shards.blocks().block > 0, "ZeroOptimizer: state_bits=8 was set after construction; "
                    "its buffers are not laid out in whole 256-element blocks: construct the ZeroOptimizer with "
                    "state_bits=8 (a state can move over through consolidate_state_dict and load_state_dict)");
  return zero_shards.blocked(zero_shards.shard_index(shard));
}

template <class Base>
std::vector<typename Base::StepPart> ZeroOptimizer<Base>::step_parts(const at::Tensor& shard,
                                                                     const at::Tensor& step) const {
  std::vector<typename Base::StepPart> parts;
  // Each run steps on a copy of its first parameter's counter (the fused call advances the copy);
  // step_group then advances every stepped parameter's own counter.
  for (const auto& run : zero_shards.step_runs(zero_shards.shard_index(shard)))
    parts.push_back({run.offset, run.numel, step.select(0, static_cast<int64_t>(run.slot)).clone()});
  return parts;
}

template <class Base>
at::Tensor ZeroOptimizer<Base>::step(torch::optim::Optimizer::LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  zero_shards.reduce_gradients();
  this->step_scaled(std::nullopt, std::nullopt);
  return loss;
}

template <class Base>
void ZeroOptimizer<Base>::step_group(size_t index, std::vector<at::Tensor>& params,
                                     const std::optional<at::Tensor>& grad_scale,
                                     const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK_VALUE(this->param_groups().size() == 1, "ZeroOptimizer: it has ", this->param_groups().size(),
                    " parameter groups; it steps one group over its flat buffers (add_param_group is not supported): "
                    "make another ZeroOptimizer for parameters with other options");
  zero_shards.reduce_gradients();
  zero_shards.before_step();
  if (zero_shards.offloaded()) {
    step_on_host(index, params, grad_scale, found_inf);
  } else {
    Base::step_group(index, params, grad_scale, found_inf);  // the fused step on this rank's shards
  }
  const auto& shards = zero_shards.shard_params();
  for (size_t k = 0; k < shards.size(); ++k) {
    const auto found = this->state_.find(shards[k].unsafeGetTensorImpl());
    if (found == this->state_.end()) continue;
    const at::Tensor& counters = static_cast<typename Base::ParamState&>(*found->second).step();
    zero_shards.advance_counters(k, counters,
                                 found_inf && zero_shards.offloaded() ? found_inf->to(counters.device()) : found_inf);
  }
  zero_shards.after_step();
}

template <class Base>
void ZeroOptimizer<Base>::step_on_host(size_t index, const std::vector<at::Tensor>& params,
                                       const std::optional<at::Tensor>& grad_scale,
                                       const std::optional<at::Tensor>& found_inf) {
  // The scaler's scale and overflow flag read on the host: the one host synchronisation of an offloaded step
  // beyond waiting for each gradient's copy (a GPU step reads them on the device).
  const auto on_host = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional<at::Tensor>(t->to(at::kCPU)) : std::nullopt;
  };
  const auto host_scale = on_host(grad_scale), host_inf = on_host(found_inf);
  for (const at::Tensor& shard : params) {  // bucket by bucket: each sent back while the next one steps
    const size_t k = zero_shards.shard_index(shard);
    zero_shards.wait_for_host_gradient(k);
    const double begin = zero_shards.seconds_since_reduction();
    {
      UnbudgetedScope host;  // host memory: not the device's (a CPU MemoryBudget stands for the device)
      std::vector<at::Tensor> one{shard};
      Base::step_group(index, one, host_scale, host_inf);
    }
    zero_shards.record("step", k, begin);
    zero_shards.send_shard(k);
  }
}

template <class Base>
std::vector<NamedTensors> ZeroOptimizer<Base>::shard_states() const {
  std::vector<NamedTensors> states;
  for (const at::Tensor& shard : zero_shards.shard_params()) {
    const auto found = this->state_.find(shard.unsafeGetTensorImpl());
    states.push_back(found == this->state_.end()
                         ? NamedTensors{}
                         : named_of(static_cast<const typename Base::ParamState&>(*found->second)));
  }
  return zero_shards.with_masters(std::move(states));
}

template <class Base>
typename ZeroOptimizer<Base>::Loaded ZeroOptimizer<Base>::prepare(std::vector<NamedTensors> states,
                                                                  std::unique_ptr<Options> options, int64_t steps) const {
  const auto& shards = zero_shards.shard_params();
  Loaded loaded;
  loaded.masters = zero_shards.take_masters(states);  // checks the count too
  loaded.states.resize(shards.size());
  for (size_t k = 0; k < shards.size(); ++k)
    if (!states[k].empty())
      loaded.states[k] = state_from(states[k], shards[k], k,
                                    static_cast<int64_t>(zero_shards.bucket(k).slots.size()),
                                    static_cast<const typename Base::ParamState*>(nullptr));
  if (options) check_options<Base>(*options);
  loaded.options = std::move(options);
  loaded.steps = steps;
  return loaded;
}

template <class Base>
void ZeroOptimizer<Base>::load_agreed(const std::string& what, const std::function<Loaded(dist::Agreement&)>& read) {
  dist::Agreement agreement(what);
  std::optional<Loaded> loaded;
  agreement.check([&] { loaded.emplace(read(agreement)); });
  // Shard files saved after a load carry a new id: files of saves before and after it never pass for one save.
  agreement.propose("optimizer id", dist::random_id());
  const std::string id = agreement.exchange(zero_shards.communicator()).at(0).second;
  TORCH_INTERNAL_ASSERT(loaded.has_value(), what, ": the agreement passed without this rank's load");
  // Every rank read and checked its part: the swap (nothing here fails on checked input).
  zero_shards.install_loaded(loaded->masters, id, loaded->steps);
  const auto& shards = zero_shards.shard_params();
  for (size_t k = 0; k < shards.size(); ++k) {
    void* key = shards[k].unsafeGetTensorImpl();
    if (loaded->states[k]) {
      zero_shards.group_counters(k, loaded->states[k]->step());
      this->state_[key] = std::move(loaded->states[k]);
    } else {
      zero_shards.group_counters(k, at::Tensor());
      this->state_.erase(key);
    }
  }
  if (loaded->options) this->param_groups()[0].set_options(std::move(loaded->options));
}

template <class Base>
void ZeroOptimizer<Base>::save(torch::serialize::OutputArchive& archive) const {
  zero_shards.write_shard(archive, kind(), shard_states(), this->param_groups()[0].options());
}

template <class Base>
void ZeroOptimizer<Base>::save_shard(const std::string& path) const {
  zero_shards.save_shard(path, kind(), shard_states(), this->param_groups()[0].options());
}

namespace {
// Shard files hold a state for every flat buffer from the first step on (a buffer none of whose parameters had
// a gradient keeps zeros and step 0): a state for some buffers and not others is a damaged or crafted file, not
// a fresh start. (A per-parameter state, as torch's, may leave out parameters never stepped: not checked there.)
void check_every_buffer(const std::vector<NamedTensors>& states) {
  const auto with_state = std::count_if(states.begin(), states.end(), [](const NamedTensors& st) {
    return std::any_of(st.begin(), st.end(), [](const auto& field) { return field.first != "master_param"; });
  });
  TORCH_CHECK_VALUE(with_state == 0 || with_state == static_cast<int64_t>(states.size()), "ZeroOptimizer: the state "
                    "has entries for ", with_state, " of the ", states.size(), " flat buffers; a state saved after a "
                    "step has every buffer's, one saved before any step none (a damaged or crafted file)");
}

template <class Options>
std::unique_ptr<Options> options_from(torch::serialize::InputArchive& archive) {
  auto options = std::make_unique<Options>(0.0);
  options->serialize(archive);
  return options;
}
}  // namespace

template <class Base>
void ZeroOptimizer<Base>::load(torch::serialize::InputArchive& archive) {
  load_agreed("ZeroOptimizer.load", [&](dist::Agreement& agreement) {
    auto read = zero_shards.read_own(archive, kind());
    check_every_buffer(read.states);
    agreement.field("checkpoint (optimizer id:steps)", read.checkpoint);
    return prepare(std::move(read.states), options_from<Options>(read.options), read.steps);
  });
}

template <class Base>
void ZeroOptimizer<Base>::load_shards(const std::vector<std::string>& files, bool allow_reshard) {
  load_agreed("ZeroOptimizer.load_shards", [&](dist::Agreement& agreement) {
    agreement.field("number of files", std::to_string(files.size()))
        .field("allow_reshard", allow_reshard ? "true" : "false");
    auto read = zero_shards.read_shards(files, kind(), allow_reshard);
    check_every_buffer(read.states);
    agreement.field("checkpoint (optimizer id:steps)", read.checkpoint);
    return prepare(std::move(read.states), options_from<Options>(read.options), read.steps);
  });
}

template <class Base>
std::vector<NamedTensors> ZeroOptimizer<Base>::consolidate_state(int to) {
  return zero_shards.consolidate(shard_states(), to);
}

template <class Base>
void ZeroOptimizer<Base>::load_full_state(const std::vector<NamedTensors>& per_param) {
  load_agreed("ZeroOptimizer.load_state_dict", [&](dist::Agreement& agreement) {
    std::vector<at::Tensor> values;  // every rank must load the same state
    for (const auto& state : per_param)
      for (const auto& [name, t] : state) values.push_back(t);
    agreement.field("state", fmt::format("{} parameters, fingerprint {}", per_param.size(), dist::fingerprint(values)));
    return prepare(zero_shards.shard_states_of(with_8bit_where_laid_out(per_param, zero_shards)), nullptr,
                   zero_shards.steps());
  });
}

template <class Base>
int64_t ZeroOptimizer<Base>::state_bytes() const {
  int64_t bytes = zero_shards.master_bytes();
  for (const auto& [key, state] : this->state_)
    for (const auto& [name, t] : named_of(static_cast<const typename Base::ParamState&>(*state)))
      bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

template class ZeroOptimizer<AdamW>;
template class ZeroOptimizer<Adam>;
template class ZeroOptimizer<SGD>;

}  // namespace gpuops::optim
