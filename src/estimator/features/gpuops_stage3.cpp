// gpuops' ZeroOptimizer(stage=3) (ShardingLayout::Gpuops, zero_units.cpp): one flat buffer per unit, unit 0 the
// rest of the model (embeddings, final norm, head) and each block one unit; fp32 gradient shards from
// construction on; zero_prefetch units gathered ahead of the one running.
#include <algorithm>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// Unit 0 is gathered for the forward and again from the loss's backward to the end; each block is gathered for
// its forward and backward with zero_prefetch more launched ahead (all blocks from forward to backward without
// reshard_after_forward). A unit's full gradient buffer (the parameters' dtype) lives from its first gradient to
// its reduction: unit 0's from the head's gradient to the end of the backward, a block's through its backward.
// A 16-bit unit is reduced through an fp32 copy of its gradient; over Gloo (the CPU) a reduce-scatter works on a
// clone of its input and an all-gather on a copy of its output.
int64_t units_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) {
  const ParameterGroups g = parameter_groups(m);
  const int64_t wb = trainable_element_bytes(s);
  const bool sixteen = wb != 4;
  const C block = C(g.per_layer()) * wb;
  const C root_params = C(g.embeddings) + g.final_norm + g.head, root = root_params * wb;
  const C gathered = s.reshard_after_forward ? C(std::min<int64_t>(1 + s.zero_prefetch, m.num_layers)) * block
                                             : C(m.num_layers) * block;
  const C root_grads = root_params * wb, block_grads = C(g.per_layer()) * wb;
  // The reduction of one unit of `n` parameters: fp32 rows for a 16-bit one; Gloo's clone of the input on the CPU.
  const auto reducing = [&](const C& n) {
    return (sixteen ? n * 4 : C(0)) + (s.num_gpus > 1 ? n * (sixteen ? 4 : wb) : C(0));
  };
  // One reduction stays in flight (its full gradient and fp32 reduced shard) until the backward's end.
  const C pending = block_grads + C(ceil_div(g.per_layer(), s.num_gpus)) * 4;
  switch (phase) {
    // (the head's gradient makes unit 0's buffer after the loss moment: gpuops_head_bytes)
    case StepPhase::LossBackward: return (root + (s.reshard_after_forward ? C(0) : gathered)).get();
    // (a block's backward behind the last's: the previous block's reduction in flight, Gloo's clone of its
    // fp32 input on the CPU)
    case StepPhase::AttentionBackward:
      return (root + gathered + root_grads + block_grads +
              (m.num_layers > 1 ? block_grads + C(ceil_div(g.per_layer(), s.num_gpus)) * 4 +
                                      (!sixteen && s.num_gpus > 1 ? block_grads : C(0))
                                : C(0)))
          .get();
    case StepPhase::BackwardEnd:  // the units freed, unit 0 reduced last (the embedding's gradient still held),
                                  // behind the last block's reduction
      return (root_grads + reducing(root_params) + C(ceil_div(root_params.get(), s.num_gpus)) * 4 + pending +
              C(g.embeddings) * wb)
          .get();
    case StepPhase::OptimizerStep: return 0;
  }
  return 0;
}

class GpuopsStage3Feature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    GPUOPS_CHECK_ARG(s.zero_prefetch >= 0 && s.zero_prefetch <= 64, "zero-prefetch must be in [0, 64] units, got {}",
                     s.zero_prefetch);
    GPUOPS_CHECK_ARG(s.zero_prefetch == 1 || on(s), "zero-prefetch applies to sharding gpuops only (its "
                     "ZeroOptimizer's prefetch); accepted: sharding gpuops, or zero-prefetch 1");
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(s.zero_stage == 3, "sharding gpuops is gpuops.ZeroOptimizer(stage=3); accepted: zero 3 (or 0 "
                     "on the command line and in Python, which means 3), got zero {}", s.zero_stage);
    GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly, "sharding gpuops needs an architecture (a unit per "
                     "block), not a bare parameter count; accepted: a preset or a config.json");
    GPUOPS_CHECK_ARG(s.lora.rank == 0, "sharding gpuops shards the trainable parameters only: with LoRA the frozen "
                     "base would stay whole on every rank; accepted: lora-rank 0 (or zero 2 for LoRA)");
    GPUOPS_CHECK_ARG(s.optimizer == OptimizerKind::AdamW || s.optimizer == OptimizerKind::Adam ||
                         s.optimizer == OptimizerKind::Sgd || s.optimizer == OptimizerKind::SgdMomentum,
                     "sharding gpuops steps gpuops' AdamW, Adam or SGD; accepted: adamw, adam, sgd, sgd-momentum, "
                     "got {}", to_string(s.optimizer));
  }
  bool on(const TrainingSetup& s) const override { return s.sharding == ShardingLayout::Gpuops; }
  bool gradients_before_backward() const override { return true; }  // the fp32 shards
  void persistent(const StepContext& c, MemoryBreakdown& b) const override {
    // The fp32 gradient shards (offload_optimizer: ZeroOptimizer(offload="cpu") keeps them on the host, with the
    // fp32 shard and the states: offload.cpp; the device keeps the shard its units gather, in the weights).
    b.gradients = c.setup.offload_optimizer ? 0 : (4 * C(sharded_trainable_elements(c.model, c.setup, 1))).get();
  }
  int64_t gathered_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) const override {
    return s.num_gpus == 1 ? 0 : units_bytes(m, s, phase);
  }
  void moments(const StepContext& c, const MomentTerms& t, Moments& moments) const override {
    // The head's gradient goes into unit 0's buffer (gpuops_head_bytes), not beside the gradients.
    moment(moments, StepPhase::AttentionBackward).gradients = t.gradients_so_far;
    if (!has_lm_head(c.model)) return;
    MemoryBreakdown& loss = moment(moments, StepPhase::LossBackward);
    MemoryBreakdown head = loss;
    head.logits = 0;
    head.temporaries = (C(t.hidden_gradient) + t.backward_extras + gpuops_head_bytes(c.model, c.setup)).get();
    if (head.total() > loss.total()) loss = head;
  }
};

}  // namespace

int64_t gpuops_head_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.sharding != ShardingLayout::Gpuops || s.num_gpus == 1) return 0;
  const ParameterGroups g = parameter_groups(m);
  const int64_t wb = trainable_element_bytes(s);
  const C root = (C(g.embeddings) + g.final_norm + g.head) * wb;
  const C head_grad = C(m.vocab_size) * m.hidden_size * wb;  // copied into the buffer, then freed
  const C blocks = s.reshard_after_forward ? C(0) : C(m.num_layers) * g.per_layer() * wb;
  return (2 * root + head_grad + blocks).get();  // unit 0 gathered, its gradient buffer
}

const SetupFeature& gpuops_stage3_feature() {
  static const GpuopsStage3Feature feature;
  return feature;
}

}  // namespace gpuops::estimator
