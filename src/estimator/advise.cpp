// --advise: every memory lever the estimator models, applied to a setup one at a time (and in pairs, then
// triples, when none suffices), each estimated with estimate_memory on the CUDA profile, judged with fits_on and ranked by what it
// costs, then by the memory it saves.
#include "gpuops/estimator/advise.h"

#include <algorithm>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"

namespace gpuops::estimator {
namespace {

constexpr int64_t kLoraRank = 16;
constexpr int kMostChanges = 3;  // combinations of up to three levers when fewer do not fit  // the LoRA of the CLI's default example (rank 16 on q,k,v,o)

// One way of applying a lever.
struct Variant {
  std::string description, options;
  TrainingSetup setup;
};

// A lever: its variants for a setup, from the least change to the most (none when it does not apply). Levers
// of the same nonzero group are alternatives to each other (two optimizers, two LoRA bases): never a pair.
struct Lever {
  AdviceCost cost;
  int group;
  std::vector<Variant> (*variants)(const ModelSpec&, const TrainingSetup&);
};

bool has_architecture(const ModelSpec& m) { return m.family != ModelFamily::ParamsOnly; }
bool is_adam(const TrainingSetup& s) { return s.optimizer == OptimizerKind::Adam || s.optimizer == OptimizerKind::AdamW; }

std::vector<Variant> fused_optimizer(const ModelSpec&, const TrainingSetup& s) {
  if (!is_adam(s) || s.optimizer_impl == OptimizerImpl::Fused) return {};
  TrainingSetup t = s;
  t.optimizer_impl = OptimizerImpl::Fused;
  return {{"fused optimizer step (no temporaries)", "--optimizer-impl fused", t}};
}

std::vector<Variant> flash_attention(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || s.attention == AttentionKind::Flash) return {};
  TrainingSetup t = s;
  t.attention = AttentionKind::Flash;
  return {{"flash attention", "--attention flash", t}};
}

// The sparsest every:K first (least recomputation), denser than the setup's own, then full.
std::vector<Variant> checkpointing(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || s.checkpoint == CheckpointKind::Full) return {};
  std::vector<Variant> out;
  const int64_t sparsest = s.checkpoint == CheckpointKind::EveryK ? s.checkpoint_every_k - 1 : m.num_layers;
  for (int64_t k = sparsest; k >= 2; --k) {
    TrainingSetup t = s;
    t.checkpoint = CheckpointKind::EveryK;
    t.checkpoint_every_k = k;
    out.push_back({fmt::format("activation checkpointing of one block in {}", k),
                   fmt::format("--checkpointing every:{}", k), t});
  }
  if (s.checkpoint != CheckpointKind::Selective) {
    TrainingSetup t = s;
    t.checkpoint = CheckpointKind::Selective;
    out.push_back({"selective activation checkpointing (every other matmul output recomputed)",
                   "--checkpointing selective", t});
  }
  TrainingSetup t = s;
  t.checkpoint = CheckpointKind::Full;
  out.push_back({"activation checkpointing of every block", "--checkpointing full", t});
  return out;
}

// Each smaller divisor b of the micro-batch, largest first, with grad-accum scaled to keep the global batch.
std::vector<Variant> smaller_micro_batch(const ModelSpec&, const TrainingSetup& s) {
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= s.micro_batch / d; ++d) {
    if (s.micro_batch % d != 0) continue;
    divisors.push_back(d);
    divisors.push_back(s.micro_batch / d);
  }
  std::sort(divisors.begin(), divisors.end(), std::greater<>());
  divisors.erase(std::unique(divisors.begin(), divisors.end()), divisors.end());
  std::vector<Variant> out;
  for (int64_t b : divisors) {
    if (b == s.micro_batch) continue;
    TrainingSetup t = s;
    t.micro_batch = b;
    t.grad_accum = (CheckedInt(s.grad_accum) * (s.micro_batch / b)).get();
    out.push_back({fmt::format("micro-batch {} with grad-accum {} (same global batch)", b, t.grad_accum),
                   fmt::format("--batch {} --grad-accum {}", b, t.grad_accum), t});
  }
  return out;
}

std::vector<Variant> zero_stage(const ModelSpec&, const TrainingSetup& s) {
  std::vector<Variant> out;
  if (s.num_gpus < 2) return out;
  for (int stage = s.zero_stage + 1; stage <= 3; ++stage) {
    TrainingSetup t = s;
    t.zero_stage = stage;
    out.push_back({fmt::format("ZeRO stage {} over the {} GPUs", stage, s.num_gpus), fmt::format("--zero {}", stage), t});
  }
  return out;
}

std::vector<Variant> eight_bit_optimizer(const ModelSpec&, const TrainingSetup& s) {
  if (!is_adam(s)) return {};
  TrainingSetup t = s;
  t.optimizer = OptimizerKind::AdamW8bit;
  return {{"8-bit AdamW (bitsandbytes)", "--optimizer adamw-8bit", t}};
}

std::vector<Variant> gpuops_eight_bit_optimizer(const ModelSpec& m, const TrainingSetup& s) {
  const bool gpuops_zero = s.zero_reduce_at_step || s.zero_bucket_bytes > 0;  // gpuops' ZeroOptimizer (stages 1-2)
  if (!is_adam(s) || s.zero_stage > 2 || (s.zero_stage > 0 && s.sharding != ShardingLayout::Flat) ||
      (s.offload_optimizer && !gpuops_zero) || m.family == ModelFamily::ParamsOnly)
    return {};
  TrainingSetup t = s;
  t.optimizer = OptimizerKind::GpuopsAdamW8bit;
  return {{"8-bit AdamW states (gpuops: optim.AdamW(state_bits=8); one fused pass, its CPU step slower)",
           "--optimizer gpuops-adamw-8bit", t}};
}

std::vector<Variant> offload_optimizer(const ModelSpec&, const TrainingSetup& s) {
  if (!is_adam(s) || s.offload_optimizer) return {};
  TrainingSetup t = s;
  t.offload_optimizer = true;
  // gpuops' ZeroOptimizer: stages 1-2 (--zero-reduce), stage 3 (--sharding gpuops)
  if (s.zero_reduce_at_step || s.zero_bucket_bytes > 0 || s.sharding == ShardingLayout::Gpuops)
    return {{"optimizer states and step on the host (gpuops: ZeroOptimizer(offload=\"cpu\"); the CPU step)",
             "--offload-optimizer", t}};
  return {{"optimizer states and step on the host (ZeRO-Offload)", "--offload-optimizer", t}};
}

std::vector<Variant> other_optimizer(const TrainingSetup& s, OptimizerKind kind, const char* description) {
  if (!is_adam(s)) return {};
  TrainingSetup t = s;
  t.optimizer = kind;
  return {{description, fmt::format("--optimizer {}", to_string(kind)), t}};
}

std::vector<Variant> paged_eight_bit_optimizer(const ModelSpec&, const TrainingSetup& s) {
  return other_optimizer(s, OptimizerKind::PagedAdamW8bit, "paged 8-bit AdamW (bitsandbytes; large states on the host)");
}

std::vector<Variant> adafactor(const ModelSpec&, const TrainingSetup& s) {
  return other_optimizer(s, OptimizerKind::Adafactor, "Adafactor (factored second moment, no first moment)");
}

// Two alternatives for the loss: chunked cross-entropy (torchtune, litgpt) and Liger's fused linear
// cross-entropy (no full logits at all, one more dependency).
std::vector<Variant> chunked_loss(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || s.loss != LossKind::Standard) return {};
  TrainingSetup t = s;
  t.loss = LossKind::Chunked;
  t.loss_chunks = 8;
  return {{t.loss_upcast ? "cross-entropy in 8 token chunks (torchtune, litgpt)"
                          : "cross-entropy in 8 token chunks on the 16-bit logits",
           "--loss " + loss_to_string(t), t}};
}

std::vector<Variant> fused_linear_ce(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || s.loss == LossKind::FusedLinearCe) return {};
  TrainingSetup t = s;
  t.loss = LossKind::FusedLinearCe;
  t.loss_upcast = true;
  return {{"fused linear cross-entropy (Liger kernel: no full logits)", "--loss fused-linear-ce", t}};
}

std::vector<Variant> drop_held_logits(const ModelSpec&, const TrainingSetup& s) {
  if (s.held_logits == HeldLogits::None) return {};
  TrainingSetup t = s;
  t.held_logits = HeldLogits::None;
  return {{"keep only the loss, not the logits, through the backward", "--held-logits none", t}};
}

std::vector<Variant> grads_to_none(const ModelSpec&, const TrainingSetup& s) {
  if (s.grads_set_to_none) return {};
  TrainingSetup t = s;
  t.grads_set_to_none = true;
  return {{"zero_grad(set_to_none=True): no gradients held through the forward", "--zero-grad none", t}};
}

std::vector<Variant> reduce_in_backward(const ModelSpec&, const TrainingSetup& s) {
  if (s.zero_stage < 1 || s.zero_stage > 2 || s.num_gpus < 2 || !s.zero_reduce_at_step) return {};
  TrainingSetup t = s;
  t.zero_reduce_at_step = false;
  return {{"gradients reduce-scattered during the backward", "--zero-reduce backward", t}};
}

std::vector<Variant> compiled(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || s.compile || s.attention == AttentionKind::Eager) return {};
  TrainingSetup t = s;
  t.compile = true;
  return {{"torch.compile the model (inductor saves fewer activations)", "--compile", t}};
}

std::vector<Variant> master_copy(const ModelSpec&, const TrainingSetup& s) {
  if (!is_mixed(s.precision) || s.precision == Precision::Bf16Pure || s.amp == AmpLayout::MasterCopy) return {};
  TrainingSetup t = s;
  t.amp = AmpLayout::MasterCopy;
  return {{"16-bit weights with an fp32 master copy (the model runs in 16 bits)", "--amp master-copy", t}};
}

std::vector<Variant> no_lora_dropout(const ModelSpec&, const TrainingSetup& s) {
  if (s.lora.rank == 0 || s.lora_dropout == 0.0) return {};
  TrainingSetup t = s;
  t.lora_dropout = 0.0;
  return {{"LoRA without dropout (no dropped copy of each adapter input)", "--lora-dropout 0", t}};
}

// LoRA rank 16 on those of q,k,v,o the model has.
TrainingSetup with_lora(const ModelSpec& m, const TrainingSetup& s, BaseWeightDtype base) {
  TrainingSetup t = s;
  t.lora.rank = std::min(kLoraRank, m.hidden_size);
  t.lora.targets.clear();
  const std::vector<std::string> names = projection_names(m);
  for (const char* p : {"q", "k", "v", "o"})
    if (std::find(names.begin(), names.end(), p) != names.end()) t.lora.targets.emplace_back(p);
  t.lora.base = base;
  return t;
}

std::string lora_options(const TrainingSetup& t) {
  return fmt::format("--lora-rank {} --lora-targets {} --base-dtype {}", t.lora.rank, fmt::join(t.lora.targets, ","),
                     to_string(t.lora.base));
}

std::vector<Variant> lora_bf16(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || s.lora.rank > 0) return {};
  const TrainingSetup t = with_lora(m, s, BaseWeightDtype::Bf16);
  return {{fmt::format("LoRA rank {} on {} with a bf16 base", t.lora.rank, fmt::join(t.lora.targets, ",")),
           lora_options(t), t}};
}

std::vector<Variant> lora_nf4(const ModelSpec& m, const TrainingSetup& s) {
  if (!has_architecture(m) || (s.lora.rank > 0 && s.lora.base == BaseWeightDtype::Nf4)) return {};
  TrainingSetup t = s;
  if (s.lora.rank == 0) t = with_lora(m, s, BaseWeightDtype::Nf4);
  t.lora.base = BaseWeightDtype::Nf4;
  return {{fmt::format("QLoRA: LoRA rank {} on {} with an nf4 base", t.lora.rank, fmt::join(t.lora.targets, ",")),
           lora_options(t), t}};
}

// Cheapest first (the order within a cost is the order of the table): levers that change nothing but memory,
// then those that recompute, slow the step, add communication, and last those that change the numerics (what is
// trained, how it is stored or rounded).
constexpr int kLossGroup = 1, kOptimizerGroup = 2, kLoraGroup = 3;
constexpr Lever kLevers[] = {
    {AdviceCost::None, 0, fused_optimizer},
    {AdviceCost::None, 0, flash_attention},
    {AdviceCost::None, kLossGroup, chunked_loss},
    {AdviceCost::None, kLossGroup, fused_linear_ce},
    {AdviceCost::None, 0, drop_held_logits},
    {AdviceCost::None, 0, grads_to_none},
    {AdviceCost::None, 0, reduce_in_backward},
    {AdviceCost::None, 0, compiled},
    {AdviceCost::Recompute, 0, checkpointing},
    {AdviceCost::Slower, 0, smaller_micro_batch},
    {AdviceCost::Slower, 0, offload_optimizer},
    {AdviceCost::Communication, 0, zero_stage},
    {AdviceCost::Numerics, kOptimizerGroup, eight_bit_optimizer},
    {AdviceCost::Numerics, kOptimizerGroup, gpuops_eight_bit_optimizer},
    {AdviceCost::Numerics, kOptimizerGroup, paged_eight_bit_optimizer},
    {AdviceCost::Numerics, kOptimizerGroup, adafactor},
    {AdviceCost::Numerics, 0, master_copy},
    {AdviceCost::Numerics, 0, no_lora_dropout},
    {AdviceCost::Numerics, kLoraGroup, lora_bf16},
    {AdviceCost::Numerics, kLoraGroup, lora_nf4},
};

struct Candidate {
  Variant variant;
  MemoryBreakdown breakdown;
  bool fits = false;
};

// The first variant that fits, else the one with the lowest estimate; none when every variant is refused.
std::optional<Candidate> pick(const ModelSpec& m, const std::vector<Variant>& variants, const GpuModel& gpu,
                              const DeviceProfile& device) {
  std::optional<Candidate> best;
  for (const Variant& v : variants) {
    MemoryBreakdown b;
    try {
      b = estimate_memory(m, v.setup, device);
    } catch (const ArgumentError&) {  // not a valid setup for this model (or past 2^63 bytes): not advice
      continue;
    }
    const bool fits = fits_on(b, gpu);
    if (fits) return Candidate{v, b, true};
    if (!best || b.total() < best->breakdown.total()) best = Candidate{v, b, false};
  }
  return best;
}

Advice to_advice(const Candidate& c, int changes, AdviceCost cost, int64_t given) {
  Advice a;
  a.description = c.variant.description;
  a.options = c.variant.options;
  a.changes = changes;
  a.cost = cost;
  a.keeps_numerics = cost != AdviceCost::Numerics;
  a.saved_bytes = given - c.breakdown.total();
  a.setup = c.variant.setup;
  a.breakdown = c.breakdown;
  a.fits = c.fits;
  return a;
}

}  // namespace

std::vector<Advice> advise(const ModelSpec& m, const TrainingSetup& setup, const GpuModel& gpu,
                           const CudaRuntime& runtime) {
  GPUOPS_CHECK_ARG(gpu.memory_bytes > 0, "gpu '{}' has memory_bytes {}; accepted: > 0", gpu.name, gpu.memory_bytes);
  const DeviceProfile device = device_of(gpu, runtime);
  const int64_t given = estimate_memory(m, setup, device).total();  // validates

  constexpr size_t kCount = std::size(kLevers);
  std::vector<std::optional<Candidate>> singles(kCount);
  std::vector<Advice> out;
  bool single_fits = false;
  for (size_t i = 0; i < kCount; ++i) {
    singles[i] = pick(m, kLevers[i].variants(m, setup), gpu, device);
    if (!singles[i] || singles[i]->breakdown.total() >= given) {  // saves nothing here
      singles[i].reset();
      continue;
    }
    single_fits = single_fits || singles[i]->fits;
    out.push_back(to_advice(*singles[i], 1, kLevers[i].cost, given));
  }

  // Combinations, only while nothing simpler fits: pairs, then triples, each a lever searched on top of a smaller
  // combination's pick. Of a size: those that fit, else the one that comes closest.
  struct Combination {
    Candidate candidate;
    std::vector<size_t> levers;
    AdviceCost cost;
  };
  std::vector<Combination> smaller;
  for (size_t i = 0; i < kCount; ++i)
    if (singles[i]) smaller.push_back({*singles[i], {i}, kLevers[i].cost});
  bool fits = single_fits;
  for (int size = 2; size <= kMostChanges && !fits; ++size) {
    std::vector<Combination> combinations;
    for (const Combination& c : smaller) {
      for (size_t j = c.levers.back() + 1; j < kCount; ++j) {
        const bool alternative = std::any_of(c.levers.begin(), c.levers.end(), [&](size_t i) {
          return kLevers[i].group != 0 && kLevers[i].group == kLevers[j].group;
        });
        if (!singles[j] || alternative) continue;
        const std::optional<Candidate> next = pick(m, kLevers[j].variants(m, c.candidate.variant.setup), gpu, device);
        if (!next) continue;
        const int64_t alone = std::min(c.candidate.breakdown.total(), singles[j]->breakdown.total());
        if (next->breakdown.total() >= alone) continue;  // saves no more than one of its parts
        Combination more{*next, c.levers, std::max(c.cost, kLevers[j].cost)};
        more.levers.push_back(j);
        more.candidate.variant.description = c.candidate.variant.description + " + " + next->variant.description;
        more.candidate.variant.options = c.candidate.variant.options + " " + next->variant.options;
        combinations.push_back(std::move(more));
      }
    }
    fits = std::any_of(combinations.begin(), combinations.end(), [](const Combination& c) { return c.candidate.fits; });
    const auto closest = std::min_element(combinations.begin(), combinations.end(), [](const auto& a, const auto& b) {
      return a.candidate.breakdown.total() < b.candidate.breakdown.total();
    });
    for (auto c = combinations.begin(); c != combinations.end(); ++c)
      if (fits ? c->candidate.fits : c == closest) out.push_back(to_advice(c->candidate, size, c->cost, given));
    smaller = std::move(combinations);
  }
  // Fitting first: the cheapest, single changes before combinations, the most memory saved. Then those that do
  // not fit, the smallest shortfall (the most memory saved) first: what comes closest.
  std::stable_sort(out.begin(), out.end(), [](const Advice& a, const Advice& b) {
    if (a.fits != b.fits) return a.fits;
    if (!a.fits) return a.saved_bytes > b.saved_bytes;
    if (a.cost != b.cost) return a.cost < b.cost;
    if (a.changes != b.changes) return a.changes < b.changes;
    return a.saved_bytes > b.saved_bytes;
  });
  return out;
}

std::string_view to_string(AdviceCost c) {
  switch (c) {
    case AdviceCost::None: return "none";
    case AdviceCost::Recompute: return "recompute";
    case AdviceCost::Slower: return "slower";
    case AdviceCost::Communication: return "communication";
    case AdviceCost::Numerics: return "numerics";
  }
  return "?";
}

}  // namespace gpuops::estimator
