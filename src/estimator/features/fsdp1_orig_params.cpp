// FSDP1 with use_orig_params=True under LoRA (TrainingSetup::fsdp_orig_params). FSDP1 flattens each wrapped block
// into one FlatParameter, which requires grad when any of its weights does (torch 2.11,
// distributed/fsdp/_flat_param.py: `requires_grad` of the flat parameter). In the forward every original weight
// is a view of it (_use_unsharded_views), so a frozen base weight requires grad too: its op saves the input a
// weight gradient needs (PeftOps in lora.cpp counts the block as trainable), and the backward makes the whole
// block's unsharded gradient, frozen parts included, reduce-scatters it and keeps the shard in flat_param.grad
// until the next forward resets it (_reset_flat_param_grad_info_if_needed). The root unit (embeddings, final
// norm, head) holds only frozen weights: its flat parameter does not require grad. Measured on the CPU with FSDP1
// over Gloo (bench/estimator_validation/fsdp1_per_token.py; tests/python/test_estimator_fsdp1.py).
#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// The flat parameter's dtype: the base's (FSDP1 wants one dtype per flat parameter).
int64_t flat_element_bytes(const TrainingSetup& s) { return s.lora.base == BaseWeightDtype::Fp32 ? 4 : 2; }

class Fsdp1OrigParamsFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec&) const override {
    GPUOPS_CHECK_ARG(!s.fsdp_orig_params || s.sharding == ShardingLayout::Fsdp1,
                     "fsdp-orig-params is FSDP1's use_orig_params; accepted: with sharding fsdp1");
    GPUOPS_CHECK_ARG(!s.fsdp_orig_params || !is_quantised_base(s.lora.base),
                     "fsdp-orig-params with an {} LoRA base is not modelled (bitsandbytes' quantised weights make no "
                     "weight gradient); accepted: a bf16, fp16 or fp32 base", to_string(s.lora.base));
  }
  bool on(const TrainingSetup& s) const override { return fsdp1_blocks_require_grad(s); }
  // Every block's weights get a gradient: the unit's unsharded one while its backward runs, then its shard (the
  // whole gradient on one GPU, NO_SHARD) from there to the next forward.
  void moments(const StepContext& c, const MomentTerms&, Moments& moments) const override {
    const ParameterGroups g = parameter_groups(c.model);
    const int64_t pb = flat_element_bytes(c.setup);
    const C block = C(g.per_layer()) * pb;
    const int64_t blocks = (C(g.per_layer()) * c.model.num_layers).get();
    const C kept = C(c.setup.num_gpus == 1 ? blocks : zero_shard(blocks, c.setup, 3)) * pb;
    MemoryBreakdown& attention = moment(moments, StepPhase::AttentionBackward);
    attention.gradients = (C(attention.gradients) + block).get();
    for (StepPhase phase : {StepPhase::BackwardEnd, StepPhase::OptimizerStep}) {
      MemoryBreakdown& p = moment(moments, phase);
      p.gradients = (C(p.gradients) + kept).get();
    }
  }
};

}  // namespace

bool fsdp1_blocks_require_grad(const TrainingSetup& s) {
  return s.fsdp_orig_params && s.sharding == ShardingLayout::Fsdp1 && s.lora.rank > 0;
}

const SetupFeature& fsdp1_orig_params_feature() {
  static const Fsdp1OrigParamsFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
