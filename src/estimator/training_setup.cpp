#include "gpuops/estimator/training_setup.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/estimator/printable.h"

#include "gpuops/errors.h"
#include "gpuops/estimator/state_layout.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {
namespace {

template <typename E, size_t N>
using Names = std::array<std::pair<E, std::string_view>, N>;

constexpr Names<Precision, 4> kPrecisions{{{Precision::Fp32, "fp32"},
                                           {Precision::Fp16Mixed, "fp16-mixed"},
                                           {Precision::Bf16Mixed, "bf16-mixed"},
                                           {Precision::Bf16Pure, "bf16"}}};
constexpr Names<AmpLayout, 2> kAmpLayouts{{{AmpLayout::Autocast, "autocast"},
                                          {AmpLayout::MasterCopy, "master-copy"}}};
constexpr Names<OptimizerImpl, 4> kOptimizerImpls{{{OptimizerImpl::Default, "default"},
                                                   {OptimizerImpl::ForLoop, "for-loop"},
                                                   {OptimizerImpl::Foreach, "foreach"},
                                                   {OptimizerImpl::Fused, "fused"}}};
constexpr Names<OptimizerKind, 9> kOptimizers{{{OptimizerKind::AdamW, "adamw"},
                                               {OptimizerKind::Adam, "adam"},
                                               {OptimizerKind::Sgd, "sgd"},
                                               {OptimizerKind::SgdMomentum, "sgd-momentum"},
                                               {OptimizerKind::AdamW8bit, "adamw-8bit"},
                                               {OptimizerKind::Adafactor, "adafactor"},
                                               {OptimizerKind::PagedAdamW8bit, "paged-adamw-8bit"},
                                               {OptimizerKind::PagedAdamW32bit, "paged-adamw-32bit"},
                                               {OptimizerKind::GpuopsAdamW8bit, "gpuops-adamw-8bit"}}};
constexpr Names<AttentionKind, 3> kAttention{
    {{AttentionKind::Eager, "eager"}, {AttentionKind::Sdpa, "sdpa"}, {AttentionKind::Flash, "flash"}}};
constexpr Names<BaseWeightDtype, 6> kBaseDtypes{{{BaseWeightDtype::Fp16, "fp16"},
                                                 {BaseWeightDtype::Bf16, "bf16"},
                                                 {BaseWeightDtype::Int8, "int8"},
                                                 {BaseWeightDtype::Nf4, "nf4"},
                                                 {BaseWeightDtype::Nf4NoDq, "nf4-nodq"},
                                                 {BaseWeightDtype::Fp32, "fp32"}}};
constexpr Names<ShardingLayout, 4> kShardings{{{ShardingLayout::Flat, "flat"},
                                               {ShardingLayout::Fsdp2, "fsdp2"},
                                               {ShardingLayout::Gpuops, "gpuops"},
                                               {ShardingLayout::Fsdp1, "fsdp1"}}};
constexpr Names<ReduceDtype, 2> kReduceDtypes{{{ReduceDtype::Grad, "grad"}, {ReduceDtype::Fp32, "fp32"}}};
constexpr Names<ModelCode, 2> kModelCodes{{{ModelCode::HuggingFace, "hf"}, {ModelCode::LitGpt, "litgpt"}}};
constexpr Names<HeldLogits, 3> kHeldLogits{
    {{HeldLogits::None, "none"}, {HeldLogits::Model, "model"}, {HeldLogits::Fp32, "fp32"}}};

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

template <typename E, size_t N>
E parse_name(const Names<E, N>& names, std::string_view text, const char* argument) {
  const std::string key = lower(text);
  std::vector<std::string_view> accepted;
  for (const auto& [value, name] : names) {
    if (name == key) return value;
    accepted.push_back(name);
  }
  throw ArgumentError(fmt::format("{} '{}' is not accepted; accepted: {}", argument, text,
                                  fmt::join(accepted, ", ")));
}

template <typename E, size_t N>
std::string_view name_of(const Names<E, N>& names, E value) {
  for (const auto& [v, name] : names)
    if (v == value) return name;
  return "?";
}

// An enum field holds one of its named values (a C++ caller can cast any integer into it).
template <typename E, size_t N>
void check_enum(const Names<E, N>& names, E value, const char* argument) {
  std::vector<std::string_view> accepted;
  for (const auto& [v, name] : names) accepted.push_back(name);
  GPUOPS_CHECK_ARG(name_of(names, value) != "?", "{} {} is out of range; accepted: {}", argument,
                   static_cast<int64_t>(value), fmt::join(accepted, ", "));
}

// The ranges of the activation-side options (their meaning is checked by their feature units, features/).
void validate_activation_setups(const TrainingSetup& s) {
  GPUOPS_CHECK_ARG(s.loss == LossKind::Standard || s.loss == LossKind::Chunked || s.loss == LossKind::FusedLinearCe,
                   "loss {} is out of range; accepted: standard, no-upcast, chunked:C, chunked-no-upcast:C, "
                   "fused-linear-ce", static_cast<int>(s.loss));
  GPUOPS_CHECK_ARG(s.loss_upcast || s.loss != LossKind::FusedLinearCe,
                   "loss fused-linear-ce with loss_upcast false is not accepted: Liger's loss keeps no logits; "
                   "accepted: loss_upcast true");
  check_enum(kHeldLogits, s.held_logits, "held-logits");
  check_enum(kModelCodes, s.model_code, "model-code");
}

}  // namespace

Precision parse_precision(std::string_view t) { return parse_name(kPrecisions, t, "precision"); }
AmpLayout parse_amp_layout(std::string_view t) { return parse_name(kAmpLayouts, t, "amp"); }
OptimizerKind parse_optimizer(std::string_view t) { return parse_name(kOptimizers, t, "optimizer"); }
OptimizerImpl parse_optimizer_impl(std::string_view t) { return parse_name(kOptimizerImpls, t, "optimizer-impl"); }
AttentionKind parse_attention(std::string_view t) { return parse_name(kAttention, t, "attention"); }
BaseWeightDtype parse_base_dtype(std::string_view t) { return parse_name(kBaseDtypes, t, "base-dtype"); }
ShardingLayout parse_sharding(std::string_view t) { return parse_name(kShardings, t, "sharding"); }
HeldLogits parse_held_logits(std::string_view t) { return parse_name(kHeldLogits, t, "held-logits"); }
ModelCode parse_model_code(std::string_view t) { return parse_name(kModelCodes, t, "model-code"); }
ReduceDtype parse_reduce_dtype(std::string_view t) { return parse_name(kReduceDtypes, t, "reduce-dtype"); }

int64_t parse_ds_reduce_bucket(std::string_view t) {
  if (lower(t) == "auto") return kDsReduceBucketAuto;
  const std::string text(t);
  size_t used = 0;
  double value = -1;  // 500000000 or 5e8, as DeepSpeed's configs write it
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  GPUOPS_CHECK_ARG(!text.empty() && used == text.size() && value >= 0 && value <= std::ldexp(1.0, 40) &&
                       value == std::floor(value),
                   "ds-reduce-bucket '{}' is not accepted; accepted: auto, or a whole number of elements from 0 to "
                   "2**40 (500000000 or 5e8)", text);
  return static_cast<int64_t>(value);
}

std::string ds_reduce_bucket_to_string(int64_t elements) {
  return elements == kDsReduceBucketAuto ? "auto" : std::to_string(elements);
}

bool parse_bool(std::string_view text, const char* argument) {
  const std::string key = lower(text);
  if (key == "true") return true;
  if (key == "false") return false;
  throw ArgumentError(fmt::format("{} '{}' is not accepted; accepted: true, false", argument, text));
}

void parse_checkpointing(std::string_view text, TrainingSetup& setup) {
  const std::string key = lower(text);
  if (key == "none") {
    setup.checkpoint = CheckpointKind::None;
    return;
  }
  if (key == "full") {
    setup.checkpoint = CheckpointKind::Full;
    return;
  }
  if (key == "selective") {
    setup.checkpoint = CheckpointKind::Selective;
    return;
  }
  const std::string prefix = "every:";
  bool ok = key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 &&
            key.size() - prefix.size() <= 9 &&
            std::all_of(key.begin() + prefix.size(), key.end(), [](unsigned char c) { return std::isdigit(c); });
  const int64_t k = ok ? std::stoll(key.substr(prefix.size())) : 0;
  GPUOPS_CHECK_ARG(ok && k >= 1,
                   "checkpointing '{}' is not accepted; accepted: none, full, every:K (K >= 1), selective", text);
  setup.checkpoint = CheckpointKind::EveryK;
  setup.checkpoint_every_k = k;
}

std::string_view to_string(Precision p) { return name_of(kPrecisions, p); }
std::string_view to_string(AmpLayout a) { return name_of(kAmpLayouts, a); }
std::string_view to_string(OptimizerKind o) { return name_of(kOptimizers, o); }
std::string_view to_string(OptimizerImpl o) { return name_of(kOptimizerImpls, o); }
std::string_view to_string(AttentionKind a) { return name_of(kAttention, a); }
std::string_view to_string(BaseWeightDtype b) { return name_of(kBaseDtypes, b); }
std::string_view to_string(ShardingLayout l) { return name_of(kShardings, l); }
std::string_view to_string(HeldLogits h) { return name_of(kHeldLogits, h); }
std::string_view to_string(ModelCode c) { return name_of(kModelCodes, c); }
std::string_view to_string(ReduceDtype r) { return name_of(kReduceDtypes, r); }

std::string checkpointing_to_string(const TrainingSetup& s) {
  switch (s.checkpoint) {
    case CheckpointKind::None: return "none";
    case CheckpointKind::Full: return "full";
    case CheckpointKind::EveryK: return fmt::format("every:{}", s.checkpoint_every_k);
    case CheckpointKind::Selective: return "selective";
  }
  return "?";
}

void parse_loss(std::string_view text, TrainingSetup& setup) {
  const std::string key = lower(text);
  if (key == "standard" || key == "no-upcast" || key == "fused-linear-ce") {
    setup.loss = key == "fused-linear-ce" ? LossKind::FusedLinearCe : LossKind::Standard;
    setup.loss_upcast = key != "no-upcast";
    return;
  }
  const bool upcast = key.rfind("chunked:", 0) == 0;
  const std::string prefix = upcast ? "chunked:" : "chunked-no-upcast:";
  const bool ok = key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 &&
                  key.size() - prefix.size() <= 9 &&
                  std::all_of(key.begin() + prefix.size(), key.end(), [](unsigned char c) { return std::isdigit(c); });
  const int64_t chunks = ok ? std::stoll(key.substr(prefix.size())) : 0;
  GPUOPS_CHECK_ARG(ok && chunks >= 1,
                   "loss '{}' is not accepted; accepted: standard, no-upcast (cross-entropy on 16-bit logits), "
                   "chunked:C or chunked-no-upcast:C (C >= 1 token chunks, e.g. chunked:8), fused-linear-ce", text);
  setup.loss = LossKind::Chunked;
  setup.loss_chunks = chunks;
  setup.loss_upcast = upcast;
}

std::string loss_to_string(const TrainingSetup& s) {
  switch (s.loss) {
    case LossKind::Standard: return s.loss_upcast ? "standard" : "no-upcast";
    case LossKind::Chunked: return fmt::format("chunked{}:{}", s.loss_upcast ? "" : "-no-upcast", s.loss_chunks);
    case LossKind::FusedLinearCe: return "fused-linear-ce";
  }
  return "?";
}

double parse_lora_dropout(std::string_view text) {
  // Digits with at most one '.', at least one digit: no sign, exponent, hex, inf or nan.
  const bool chars_ok = !text.empty() && text.size() <= 32 &&
                        std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) || c == '.'; });
  const bool ok = chars_ok && std::count(text.begin(), text.end(), '.') <= 1 &&
                  std::any_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); });
  GPUOPS_CHECK_ARG(ok, "lora-dropout '{}' is not a decimal probability; accepted: 0 <= p < 1, e.g. 0.05", text);
  return std::stod(std::string(text));
}

BnbVersion parse_bnb_version(std::string_view text) {
  // Two or three dot-separated numbers of 1-4 digits: nothing else (no suffix such as "rc1" or "dev").
  int parts[3] = {0, 0, 0}, count = 0, digits = 0;
  bool ok = !text.empty();
  for (const char c : text) {
    if (c == '.' && digits > 0 && count < 2) {
      ++count, digits = 0;
    } else if (std::isdigit(static_cast<unsigned char>(c)) && digits < 4) {
      parts[count] = parts[count] * 10 + (c - '0'), ++digits;
    } else {
      ok = false;
      break;
    }
  }
  GPUOPS_CHECK_ARG(ok && digits > 0 && count >= 1,
                   "bnb-version '{}' is not a release number; accepted: MAJOR.MINOR[.PATCH] such as 0.42.0 "
                   "(the bitsandbytes release of an int8/nf4 base)", printable(text));
  return {parts[0], parts[1], parts[2]};
}

std::string to_string(const BnbVersion& v) { return fmt::format("{}.{}.{}", v.major, v.minor, v.patch); }

bool parse_zero_grad(std::string_view text) {
  if (text == "none") return true;
  if (text == "zeros") return false;
  throw ArgumentError(fmt::format("zero-grad '{}' is not accepted; accepted: none (zero_grad(set_to_none=True), "
                                  "torch >= 2.0), zeros (set_to_none=False: gradients kept between steps)",
                                  printable(text)));
}

bool parse_zero_reduce(std::string_view text) {
  if (text == "backward") return false;
  if (text == "step") return true;
  throw ArgumentError(fmt::format("zero-reduce '{}' is not accepted; accepted: backward (gradients reduced in "
                                  "buckets during backward: DeepSpeed, Megatron), step (reduced at the step: gpuops' "
                                  "ZeroOptimizer)", printable(text)));
}

int64_t compute_dtype_bytes(Precision p) { return p == Precision::Fp32 ? 4 : 2; }

// Logits the loop holds in fp32 (torchtune < 0.3's model upcasts them) reach the loss in fp32 whatever it does.
int64_t loss_logit_bytes(const TrainingSetup& s) {
  return s.loss_upcast || s.held_logits == HeldLogits::Fp32 ? 4 : compute_dtype_bytes(s.precision);
}

bool is_mixed(Precision p) { return p == Precision::Fp16Mixed || p == Precision::Bf16Mixed; }

bool runs_in_16_bits(const TrainingSetup& s) {
  return s.precision == Precision::Bf16Pure || (is_mixed(s.precision) && s.amp == AmpLayout::MasterCopy);
}

void validate(const TrainingSetup& s, const ModelSpec& m) {
  check_enum(kPrecisions, s.precision, "precision");
  check_enum(kAmpLayouts, s.amp, "amp");
  check_enum(kOptimizers, s.optimizer, "optimizer");
  check_enum(kOptimizerImpls, s.optimizer_impl, "optimizer-impl");
  check_enum(kAttention, s.attention, "attention");
  check_enum(kBaseDtypes, s.lora.base, "base-dtype");
  check_enum(kReduceDtypes, s.reduce_dtype, "reduce-dtype");
  GPUOPS_CHECK_ARG(s.checkpoint == CheckpointKind::None || s.checkpoint == CheckpointKind::Full ||
                       s.checkpoint == CheckpointKind::EveryK || s.checkpoint == CheckpointKind::Selective,
                   "checkpointing {} is out of range; accepted: none, full, every:K, selective",
                   static_cast<int>(s.checkpoint));
  validate_activation_setups(s);
  GPUOPS_CHECK_ARG(s.micro_batch >= 1, "batch (micro-batch per GPU) must be >= 1, got {}", s.micro_batch);
  GPUOPS_CHECK_ARG(s.seq_len >= 1, "seq (sequence length) must be >= 1, got {}", s.seq_len);
  GPUOPS_CHECK_ARG(s.grad_accum >= 1, "grad-accum must be >= 1, got {}", s.grad_accum);
  GPUOPS_CHECK_ARG(s.num_gpus >= 1, "gpus (data-parallel world size) must be >= 1, got {}", s.num_gpus);
  try {  // the report's global batch
    (CheckedInt(s.micro_batch) * s.grad_accum * s.num_gpus).get();
  } catch (const SizeOverflow&) {
    throw ArgumentError(fmt::format("global batch (batch {} x grad-accum {} x gpus {}) overflows 64 bits; accepted: "
                                    "a product below 2^63", s.micro_batch, s.grad_accum, s.num_gpus));
  }
  GPUOPS_CHECK_ARG(s.zero_stage >= 0 && s.zero_stage <= 3, "zero stage {} is not accepted; accepted: 0, 1, 2, 3",
                   s.zero_stage);
  GPUOPS_CHECK_ARG(s.amp == AmpLayout::Autocast || is_mixed(s.precision),
                   "amp master-copy applies to mixed precision only; accepted with precision fp16-mixed or "
                   "bf16-mixed, got precision {}", to_string(s.precision));
  if (m.learned_positions) {
    GPUOPS_CHECK_ARG(s.seq_len <= m.max_positions,
                     "seq {} exceeds the {} learned positions of model '{}'; accepted: 1 to {}", s.seq_len,
                     m.max_positions, m.name, m.max_positions);
  }
  const bool fsdp2 = s.sharding == ShardingLayout::Fsdp2, gpuops = s.sharding == ShardingLayout::Gpuops;
  GPUOPS_CHECK_ARG(s.sharding == ShardingLayout::Flat || s.sharding == ShardingLayout::Fsdp1 || fsdp2 || gpuops,
                   "sharding {} is out of range; accepted: flat, fsdp2, gpuops, fsdp1", static_cast<int>(s.sharding));
  GPUOPS_CHECK_ARG(s.reshard_after_forward || fsdp2 || gpuops,
                   "reshard-after-forward false applies to sharding fsdp2 and gpuops only; accepted: sharding fsdp2 or "
                   "gpuops, or reshard-after-forward true");
  validate_features(s, m);       // every setup feature's own options (features/)
}

int64_t default_seq_len(const ModelSpec& model) {
  return model.learned_positions && model.max_positions > 0 ? std::min(kDefaultSeqLen, model.max_positions)
                                                             : kDefaultSeqLen;
}

}  // namespace gpuops::estimator
