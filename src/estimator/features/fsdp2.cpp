// FSDP2 (ShardingLayout::Fsdp2, torch's fully_shard): every tensor chunked on dim 0 and padded to
// ceil(rows / num_gpus) rows; the root module's parameters unsharded from its forward to the end of the
// backward, the blocks' resharded after their forward unless reshard_after_forward is false; gradients
// reduce-scattered per group in reduce_dtype. docs/estimator.md, "Optimizers, offload and sharding".
#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// LoRA adapter parameters inside one block (`outer` false) or outside the blocks (lm_head, embed).
C adapter_params(const ModelSpec& m, const LoraSetup& lora, bool outer) {
  C n = 0;
  for (const auto& t : lora.targets) {
    if (is_outer_lora_target(t) != outer) continue;
    const LinearShape l = outer ? outer_lora_shape(m, t) : projection_shape(m, t);
    n += lora.rank * (C(l.in_features) + l.out_features);
  }
  return n;
}

class Fsdp2Feature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    GPUOPS_CHECK_ARG(s.reduce_dtype == ReduceDtype::Grad || on(s),
                     "reduce-dtype {} applies to sharding fsdp2 only (MixedPrecisionPolicy); accepted: sharding "
                     "fsdp2, or reduce-dtype grad", to_string(s.reduce_dtype));
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(s.zero_stage == 3, "sharding fsdp2 shards weights, gradients and states (ZeRO stage 3); "
                     "accepted: zero 3 (or 0 on the command line and in Python, which means 3), got zero {}",
                     s.zero_stage);
    GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly, "sharding fsdp2 needs an architecture (per-tensor dim-0 "
                     "shards), not a bare parameter count; accepted: sharding flat with params, or a preset / "
                     "config.json");
  }
  bool on(const TrainingSetup& s) const override { return s.sharding == ShardingLayout::Fsdp2; }

  std::optional<int64_t> local_trainable_elements(const ModelSpec& m, const TrainingSetup& s,
                                                  int from_stage) const override {
    if (s.zero_stage < from_stage) return std::nullopt;
    C n = 0;
    for (const auto& t : trainable_tensor_shapes(m, s)) n += C(t.count) * fsdp2_shard_elements(t, s.num_gpus);
    return n.get();
  }

  // A quantised weight is a flat uint8 tensor to FSDP2 (bitsandbytes' Params4bit / Int8Params).
  std::optional<int64_t> local_frozen_bytes(const ModelSpec& m, const TrainingSetup& s) const override {
    C bytes = 0;
    for (const auto& t : model_tensor_shapes(m)) {
      const bool quantised =
          is_quantised_base(s.lora.base) && (t.quantisable || (t.lm_head && s.lora.quantize_lm_head));
      const int64_t shard = quantised ? ceil_div(quantised_weight_bytes(t.cols, t.rows, s.lora.base), s.num_gpus)
                                      : (2 * C(fsdp2_shard_elements(t, s.num_gpus))).get();
      bytes += C(t.count) * shard;
    }
    return bytes.get();
  }

  // The root module (embeddings, final norm, head) keeps its unsharded parameters from its forward to the end
  // of the backward. Each group's post-backward copies its unsharded gradients into one reduce-scatter input
  // in reduce_dtype (torch's foreach_reduce), both alive during the copy; the input stays until the next
  // group's reduction.
  int64_t gathered_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) const override {
    const ParameterGroups g = parameter_groups(m);
    const bool lora = s.lora.rank > 0;
    const int64_t wb = lora ? 2 : trainable_element_bytes(s);  // gathered weights: the frozen base is 16-bit
    const C block = C(g.per_layer()) * wb;
    const C root = (C(g.embeddings) + g.final_norm + g.head) * wb;
    const int64_t gb = trainable_element_bytes(s);
    const C block_trainable = lora ? adapter_params(m, s.lora, false) : C(g.per_layer());
    const C root_trainable = lora ? adapter_params(m, s.lora, true) : C(g.embeddings) + g.final_norm + g.head;
    const C block_grads = block_trainable * gb, root_grads = root_trainable * gb;
    const C all_blocks = C(m.num_layers) * block;
    const int64_t rb = s.reduce_dtype == ReduceDtype::Fp32 ? 4 : gb;
    const C block_reduce = block_trainable * rb, root_reduce = root_trainable * rb;
    switch (phase) {
      case StepPhase::LossBackward: return (root + (s.reshard_after_forward ? C(0) : all_blocks)).get();
      case StepPhase::AttentionBackward:  // the last block's backward: it and the prefetched one, its gradients
        return (root + (s.reshard_after_forward ? 2 * block : all_blocks) + block_grads + block_reduce).get();
      case StepPhase::BackwardEnd: return (root_grads + root_reduce).get();  // the root's, before its reduce-scatter
      case StepPhase::OptimizerStep: return 0;
    }
    return 0;
  }
};

}  // namespace

const SetupFeature& fsdp2_feature() {
  static const Fsdp2Feature feature;
  return feature;
}

}  // namespace gpuops::estimator
