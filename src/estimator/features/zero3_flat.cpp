// DeepSpeed's ZeRO stage 3 (zero_stage 3, ShardingLayout::Flat): the weights in flat partitions (the core's
// zero_shard), each block gathered for its forward and again for its backward with the next one prefetched.
#include "gpuops/estimator/estimate.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

class Zero3FlatFeature final : public SetupFeature {
 public:
  bool on(const TrainingSetup& s) const override { return s.zero_stage == 3 && s.sharding == ShardingLayout::Flat; }
  // The current and the prefetched block in the backward moments (a LoRA base gathered in 16 bits).
  int64_t gathered_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) const override {
    if (phase != StepPhase::LossBackward && phase != StepPhase::AttentionBackward) return 0;
    const int64_t wb = s.lora.rank > 0 ? 2 : trainable_element_bytes(s);
    return (2 * CheckedInt(parameter_groups(m).per_layer()) * wb).get();
  }
};

}  // namespace

const SetupFeature& zero3_flat_feature() {
  static const Zero3FlatFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
