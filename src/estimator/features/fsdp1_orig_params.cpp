// FSDP1 with use_orig_params=True under LoRA (TrainingSetup::fsdp_orig_params). FSDP1 flattens each wrapped block
// into one FlatParameter, which requires grad when any of its weights does (torch 2.11,
// distributed/fsdp/_flat_param.py: `requires_grad` of the flat parameter). In the forward every original weight
// is a view of it (_use_unsharded_views), so a frozen base weight requires grad too: its op saves the input a
// weight gradient needs (PeftOps in lora.cpp counts the block as trainable), and the backward makes the whole
// block's unsharded gradient, frozen parts included, reduce-scatters it and keeps the shard in flat_param.grad
// until the next forward resets it (_reset_flat_param_grad_info_if_needed: only when every original weight's
// .grad is None, so gradients kept through the forward, accumulation or zero_grad to zeros, keep the shard too).
// The root unit (embeddings, final norm, head) holds only frozen weights when LoRA targets the blocks only: its
// flat parameter does not require grad. Measured on the CPU with FSDP1 over Gloo
// (bench/estimator_validation/fsdp1_per_token.py; tests/python/test_estimator_fsdp1.py).
#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

class Fsdp1OrigParamsFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec&) const override {
    if (!s.fsdp_orig_params) return;
    GPUOPS_CHECK_ARG(s.sharding == ShardingLayout::Fsdp1,
                     "fsdp-orig-params is FSDP1's use_orig_params; accepted: with sharding fsdp1");
    if (s.lora.rank == 0) return;  // full training: every weight has its gradient anyway
    GPUOPS_CHECK_ARG(!is_quantised_base(s.lora.base),
                     "fsdp-orig-params with an {} LoRA base is not modelled (bitsandbytes' quantised weights make no "
                     "weight gradient); accepted: a bf16, fp16 or fp32 base", to_string(s.lora.base));
    GPUOPS_CHECK_ARG(!s.compile, "fsdp-orig-params with compile and LoRA is not modelled (inductor's saved tensors "
                     "of a block whose frozen weights require grad); accepted: one of them");
    GPUOPS_CHECK_ARG(block_lora_target_count(s.lora) == static_cast<int64_t>(s.lora.targets.size()),
                     "fsdp-orig-params with LoRA on lm_head or embed is not modelled (the root unit would require "
                     "grad); accepted: lora-targets among the blocks' projections");
  }
  bool on(const TrainingSetup& s) const override { return fsdp1_blocks_require_grad(s); }
  // One unit's unsharded gradient while its backward runs; every block's shard (the whole gradient on one GPU,
  // NO_SHARD) from there to the next forward, and through it when the LoRA gradients live through the forward.
  void moments(const StepContext& c, const MomentTerms&, Moments& moments) const override {
    const Fsdp1OrigGradients g = fsdp1_orig_gradients(c.model, c.setup);
    const bool through_forward = gradients_alive_in_forward(c.setup);
    for (StepPhase phase : {StepPhase::LossBackward, StepPhase::AttentionBackward, StepPhase::BackwardEnd,
                            StepPhase::OptimizerStep}) {
      const bool backward = phase == StepPhase::LossBackward || phase == StepPhase::AttentionBackward;
      C add = backward && !through_forward ? C(0) : C(g.kept);
      if (phase == StepPhase::AttentionBackward) add += g.unit;
      MemoryBreakdown& p = moment(moments, phase);
      p.gradients = (C(p.gradients) + add).get();
    }
  }
  int64_t held_through_steps(const StepContext& c) const override {
    return gradients_alive_in_forward(c.setup) ? fsdp1_orig_gradients(c.model, c.setup).kept : 0;
  }
};

}  // namespace

bool fsdp1_blocks_require_grad(const TrainingSetup& s) {
  return s.fsdp_orig_params && s.sharding == ShardingLayout::Fsdp1 && s.lora.rank > 0 &&
         block_lora_target_count(s.lora) > 0;
}

Fsdp1OrigGradients fsdp1_orig_gradients(const ModelSpec& m, const TrainingSetup& s) {
  if (!fsdp1_blocks_require_grad(s)) return {};
  const ParameterGroups g = parameter_groups(m);
  const int64_t pb = flat_parameter_element_bytes(s);
  const int64_t blocks = (C(g.per_layer()) * m.num_layers).get();
  const int64_t kept = s.num_gpus == 1 ? blocks : zero_shard(blocks, s, 3);
  return {(C(g.per_layer()) * pb).get(), (C(kept) * pb).get()};
}

const SetupFeature& fsdp1_orig_params_feature() {
  static const Fsdp1OrigParamsFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
