// DeepSpeed's ZeRO stage 3 (zero_stage 3, ShardingLayout::Flat): the weights in flat partitions (the core's
// zero_shard), each block gathered for its forward and again for its backward with the next one prefetched.
// What DeepSpeed makes at setup (runtime/zero/stage3.py, _setup_for_real_optimizer, 0.14-0.15): with
// contiguous_gradients (its default) a bucket of reduce_bucket_size elements of the model's dtype (16-bit in mixed
// precision, fp32 in fp32 training), whatever is trainable, counted here. DeepSpeed also makes the gradient
// partitions' flat buffer at setup, which the estimate counts from the backward on, as FSDP1's flat parameters
// (mapped to this layout by the published validation) make theirs: not modelled yet.
#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

bool is_deepspeed_zero3(const TrainingSetup& s) { return s.zero_stage == 3 && s.sharding == ShardingLayout::Flat; }

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
  }
  bool on(const TrainingSetup& s) const override { return is_deepspeed_zero3(s); }
  // The bucket: alive at every moment of the step, from setup on.
  void moments(const StepContext& c, const MomentTerms&, Moments& moments) const override {
    const int64_t bucket = bucket_bytes(c);
    for (MemoryBreakdown& p : moments) p.gradients = (C(p.gradients) + bucket).get();
  }
  int64_t held_through_steps(const StepContext& c) const override { return bucket_bytes(c); }
  // bitsandbytes' quantisation statistics hang on the weights as attributes, not parameters: the flat partitions
  // take param.data only (DeepSpeed's partition_parameters.py), so every rank keeps all of them. (FSDP1 rows on
  // this layout: bitsandbytes keeps a Linear4bit's quant_state on the module for FSDP, whole on every rank too.)
  std::optional<int64_t> local_frozen_bytes(const ModelSpec& m, const TrainingSetup& s) const override {
    const int64_t statistics = quantisation_statistics_bytes(m, s);
    if (statistics == 0) return std::nullopt;
    return (C(zero_shard((C(frozen_weight_bytes(m, s)) - statistics).get(), s, 3)) + statistics).get();
  }
  // The current and the prefetched block in the backward moments (a LoRA base gathered in 16 bits).
  int64_t gathered_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) const override {
    if (phase != StepPhase::LossBackward && phase != StepPhase::AttentionBackward) return 0;
    const int64_t wb = s.lora.rank > 0 ? 2 : trainable_element_bytes(s);
    return (2 * CheckedInt(parameter_groups(m).per_layer()) * wb).get();
  }

 private:
  static int64_t bucket_bytes(const StepContext& c) {
    const int64_t elements = c.setup.ds_reduce_bucket == kDsReduceBucketAuto
                                 ? (C(c.model.hidden_size) * c.model.hidden_size).get()
                                 : c.setup.ds_reduce_bucket;
    return (C(elements) * compute_dtype_bytes(c.setup.precision)).get();
  }
};

}  // namespace

const SetupFeature& zero3_flat_feature() {
  static const Zero3FlatFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
