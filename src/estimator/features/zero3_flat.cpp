// The flat ZeRO-3 layouts: DeepSpeed's ZeRO stage 3 (zero_stage 3, ShardingLayout::Flat) and torch's FSDP1
// FULL_SHARD (ShardingLayout::Fsdp1), the weights in flat partitions (the core's zero_shard), each block gathered
// for its forward and again for its backward with the next one prefetched.
// What DeepSpeed makes at setup (runtime/zero/stage3.py, _setup_for_real_optimizer, 0.14-0.15): with
// contiguous_gradients (its default) a bucket of reduce_bucket_size elements of the model's dtype (16-bit in mixed
// precision, fp32 in fp32 training), whatever is trainable, counted here. DeepSpeed also makes the gradient
// partitions' flat buffer at setup, which the estimate counts from the backward on, as FSDP1's flat parameters
// make theirs: not modelled yet.
// FSDP1 has no such bucket. Its root unit (what the wrapping policy leaves outside the wrapped blocks: the
// embeddings, final norm and head of a decoder) is gathered at the root's forward and not freed after it
// (_post_forward_reshard frees every unit's unsharded flat parameter but the root's, torch 2.0-2.5), so it stays
// through the backward until the end-of-backward callback reshards it.
#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

bool is_deepspeed_zero3(const TrainingSetup& s) { return s.zero_stage == 3 && s.sharding == ShardingLayout::Flat; }
bool is_fsdp1(const TrainingSetup& s) { return s.sharding == ShardingLayout::Fsdp1; }

class Zero3FlatFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    GPUOPS_CHECK_ARG(s.ds_reduce_bucket >= kDsReduceBucketAuto && s.ds_reduce_bucket <= int64_t{1} << 40,
                     "ds-reduce-bucket {} is not accepted; accepted: auto, or 0 to 2**40 elements", s.ds_reduce_bucket);
    GPUOPS_CHECK_ARG(s.ds_reduce_bucket == TrainingSetup{}.ds_reduce_bucket || is_deepspeed_zero3(s),
                     "ds-reduce-bucket is DeepSpeed's ZeRO-3 reduce_bucket_size; accepted: zero 3 with sharding flat, "
                     "or the default");
    GPUOPS_CHECK_ARG(s.ds_reduce_bucket != kDsReduceBucketAuto || m.hidden_size > 0, "ds-reduce-bucket auto is "
                     "hidden_size squared, and model '{}' has no hidden size (a bare parameter count); accepted: a "
                     "number of elements", m.name);
    GPUOPS_CHECK_ARG(!is_fsdp1(s) || s.zero_stage == 3, "sharding fsdp1 is FSDP1's FULL_SHARD (ZeRO stage 3); "
                     "accepted: zero 3 (or 0 on the command line and in Python, which means 3), got zero {}",
                     s.zero_stage);
  }
  bool on(const TrainingSetup& s) const override { return is_deepspeed_zero3(s) || is_fsdp1(s); }
  // The bucket: alive at every moment of the step, from setup on.
  void moments(const StepContext& c, const MomentTerms&, Moments& moments) const override {
    const int64_t bucket = bucket_bytes(c);
    for (MemoryBreakdown& p : moments) p.gradients = (C(p.gradients) + bucket).get();
  }
  int64_t held_through_steps(const StepContext& c) const override { return bucket_bytes(c); }
  // bitsandbytes' quantisation statistics hang on the weights as attributes, not parameters: the flat partitions
  // take param.data only (DeepSpeed's partition_parameters.py), so every rank keeps all of them. (FSDP1: bitsandbytes
  // keeps a Linear4bit's quant_state on the module for FSDP, whole on every rank too.)
  std::optional<int64_t> local_frozen_bytes(const ModelSpec& m, const TrainingSetup& s) const override {
    const int64_t statistics = quantisation_statistics_bytes(m, s);
    if (statistics == 0) return std::nullopt;
    return (C(zero_shard((C(frozen_weight_bytes(m, s)) - statistics).get(), s, 3)) + statistics).get();
  }
  // Gathered at the backward moments (a LoRA base gathered in 16 bits, whatever its storage). DeepSpeed: two blocks
  // at the loss and in a block's backward (its coordinator prefetches by stage3_prefetch_bucket_size, not by block:
  // two blocks is this layout's earlier reading, not re-derived), and at the loss the LM head, gathered for its
  // backward on the logits' gradient. FSDP1: the root unit at every backward moment, with the last block at the
  // loss (the root's pre-backward hook prefetches it, BACKWARD_PRE) and the current and the prefetched block in a
  // block's backward; on one GPU FSDP1 runs NO_SHARD and gathers nothing.
  int64_t gathered_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) const override {
    if (is_fsdp1(s) && s.num_gpus == 1) return 0;
    const int64_t wb = flat_parameter_element_bytes(s);
    const ParameterGroups g = parameter_groups(m);
    const C block = C(g.per_layer()) * wb;
    const C head = has_lm_head(m) ? C(m.vocab_size) * m.hidden_size * wb : C(0);
    const C root = gathered_through_backward(m, s);
    switch (phase) {
      case StepPhase::LossBackward: return (is_fsdp1(s) ? root + block : head + 2 * block).get();
      case StepPhase::AttentionBackward: return (root + 2 * block).get();
      case StepPhase::BackwardEnd: return root.get();
      case StepPhase::OptimizerStep: return 0;
    }
    return 0;
  }
  // FSDP1 on several GPUs (torch 2.11 distributed/fsdp/_runtime_utils.py: _init_streams, _unshard, _reduce_grad).
  bool gathers_on_side_streams(const TrainingSetup& s) const override { return is_fsdp1(s) && s.num_gpus > 1; }
  int64_t gathered_through_backward(const ModelSpec& m, const TrainingSetup& s) const override {
    if (!is_fsdp1(s) || s.num_gpus == 1) return 0;
    const ParameterGroups g = parameter_groups(m);
    return ((C(g.embeddings) + g.final_norm + g.head) * flat_parameter_element_bytes(s)).get();
  }

 private:
  static int64_t bucket_bytes(const StepContext& c) {
    if (!is_deepspeed_zero3(c.setup)) return 0;
    const int64_t elements = c.setup.ds_reduce_bucket == kDsReduceBucketAuto
                                 ? (C(c.model.hidden_size) * c.model.hidden_size).get()
                                 : c.setup.ds_reduce_bucket;
    return (C(elements) * compute_dtype_bytes(c.setup.precision)).get();
  }
};

}  // namespace

int64_t flat_parameter_element_bytes(const TrainingSetup& s) {
  if (s.lora.rank == 0) return trainable_element_bytes(s);
  return s.lora.base == BaseWeightDtype::Fp32 ? 4 : 2;  // a LoRA base's dtype (a quantised one gathers 16 bits)
}

const SetupFeature& zero3_flat_feature() {
  static const Zero3FlatFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
