#include "gpuops/estimator/training_setup.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <limits>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"

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
constexpr Names<OptimizerKind, 5> kOptimizers{{{OptimizerKind::AdamW, "adamw"},
                                               {OptimizerKind::Adam, "adam"},
                                               {OptimizerKind::Sgd, "sgd"},
                                               {OptimizerKind::SgdMomentum, "sgd-momentum"},
                                               {OptimizerKind::AdamW8bit, "adamw-8bit"}}};
constexpr Names<AttentionKind, 3> kAttention{
    {{AttentionKind::Eager, "eager"}, {AttentionKind::Sdpa, "sdpa"}, {AttentionKind::Flash, "flash"}}};
constexpr Names<BaseWeightDtype, 4> kBaseDtypes{{{BaseWeightDtype::Fp16, "fp16"},
                                                 {BaseWeightDtype::Bf16, "bf16"},
                                                 {BaseWeightDtype::Int8, "int8"},
                                                 {BaseWeightDtype::Nf4, "nf4"}}};

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

}  // namespace

Precision parse_precision(std::string_view t) { return parse_name(kPrecisions, t, "precision"); }
AmpLayout parse_amp_layout(std::string_view t) { return parse_name(kAmpLayouts, t, "amp"); }
OptimizerKind parse_optimizer(std::string_view t) { return parse_name(kOptimizers, t, "optimizer"); }
OptimizerImpl parse_optimizer_impl(std::string_view t) { return parse_name(kOptimizerImpls, t, "optimizer-impl"); }
AttentionKind parse_attention(std::string_view t) { return parse_name(kAttention, t, "attention"); }
BaseWeightDtype parse_base_dtype(std::string_view t) { return parse_name(kBaseDtypes, t, "base-dtype"); }

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
  const std::string prefix = "every:";
  bool ok = key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 &&
            key.size() - prefix.size() <= 9 &&
            std::all_of(key.begin() + prefix.size(), key.end(), [](unsigned char c) { return std::isdigit(c); });
  const int64_t k = ok ? std::stoll(key.substr(prefix.size())) : 0;
  GPUOPS_CHECK_ARG(ok && k >= 1, "checkpointing '{}' is not accepted; accepted: none, full, every:K (K >= 1)",
                   text);
  setup.checkpoint = CheckpointKind::EveryK;
  setup.checkpoint_every_k = k;
}

std::string_view to_string(Precision p) { return name_of(kPrecisions, p); }
std::string_view to_string(AmpLayout a) { return name_of(kAmpLayouts, a); }
std::string_view to_string(OptimizerKind o) { return name_of(kOptimizers, o); }
std::string_view to_string(OptimizerImpl o) { return name_of(kOptimizerImpls, o); }
std::string_view to_string(AttentionKind a) { return name_of(kAttention, a); }
std::string_view to_string(BaseWeightDtype b) { return name_of(kBaseDtypes, b); }

std::string checkpointing_to_string(const TrainingSetup& s) {
  switch (s.checkpoint) {
    case CheckpointKind::None: return "none";
    case CheckpointKind::Full: return "full";
    case CheckpointKind::EveryK: return fmt::format("every:{}", s.checkpoint_every_k);
  }
  return "?";
}

int64_t compute_dtype_bytes(Precision p) { return p == Precision::Fp32 ? 4 : 2; }

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
  GPUOPS_CHECK_ARG(s.checkpoint == CheckpointKind::None || s.checkpoint == CheckpointKind::Full ||
                       s.checkpoint == CheckpointKind::EveryK,
                   "checkpointing {} is out of range; accepted: none, full, every:K", static_cast<int>(s.checkpoint));
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
  if (s.checkpoint == CheckpointKind::EveryK) {
    const int64_t max_k = m.family == ModelFamily::ParamsOnly ? std::numeric_limits<int64_t>::max() : m.num_layers;
    GPUOPS_CHECK_ARG(s.checkpoint_every_k >= 1 && s.checkpoint_every_k <= max_k,
                     "checkpointing every:{} is not accepted for model '{}'; accepted: every:K with 1 <= K <= {} "
                     "(num_layers)", s.checkpoint_every_k, m.name, m.num_layers);
  }
  if (m.learned_positions) {
    GPUOPS_CHECK_ARG(s.seq_len <= m.max_positions,
                     "seq {} exceeds the {} learned positions of model '{}'; accepted: 1 to {}", s.seq_len,
                     m.max_positions, m.name, m.max_positions);
  }
  const auto& lora = s.lora;
  GPUOPS_CHECK_ARG(lora.rank >= 0, "lora-rank must be >= 0 (0 = no LoRA), got {}", lora.rank);
  if (lora.rank == 0) {
    GPUOPS_CHECK_ARG(lora.base != BaseWeightDtype::Int8 && lora.base != BaseWeightDtype::Nf4,
                     "base-dtype {} needs LoRA (a quantised base cannot be trained); give lora-rank >= 1 or "
                     "base-dtype fp16/bf16", to_string(lora.base));
    return;
  }
  GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly,
                   "lora-rank needs an architecture (a preset or a config.json), not a bare parameter count");
  GPUOPS_CHECK_ARG(lora.rank <= m.hidden_size, "lora-rank {} exceeds hidden_size {} of model '{}'; accepted: 1 to {}",
                   lora.rank, m.hidden_size, m.name, m.hidden_size);
  GPUOPS_CHECK_ARG(!lora.targets.empty(), "lora-targets is empty; accepted: a comma list of {}",
                   fmt::join(projection_names(m), ","));
  const auto names = projection_names(m);
  std::set<std::string> seen;
  for (const auto& t : lora.targets) {
    GPUOPS_CHECK_ARG(std::find(names.begin(), names.end(), t) != names.end(),
                     "lora-targets '{}' is not a projection of model '{}'; accepted: {}", t, m.name,
                     fmt::join(names, ","));
    GPUOPS_CHECK_ARG(seen.insert(t).second, "lora-targets lists '{}' twice; accepted: each of {} at most once", t,
                     fmt::join(names, ","));
  }
}

}  // namespace gpuops::estimator
