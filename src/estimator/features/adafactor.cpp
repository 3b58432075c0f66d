// Adafactor (OptimizerKind::Adafactor, transformers.optimization.Adafactor's defaults): factored fp32 second
// moments sized by every tensor's shape, and its step's per-tensor temporaries. docs/estimator.md, "Optimizers,
// offload and sharding".
#include <algorithm>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// Flat ZeRO partitions (stage >= 1 with DeepSpeed's layout) hand the optimizer 1-D fp32 tensors.
bool flat_partitions(const TrainingSetup& s) { return s.zero_stage >= 1 && s.sharding != ShardingLayout::Fsdp2; }

class AdafactorFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly, "optimizer adafactor needs an architecture (its states "
                     "depend on every tensor's shape), not a bare parameter count; accepted: a preset or a config.json");
    GPUOPS_CHECK_ARG(s.sharding != ShardingLayout::Fsdp2, "optimizer adafactor does not run on FSDP2's DTensor "
                     "parameters (transformers' Adafactor mixes them with plain tensors); accepted with sharding flat");
  }
  bool on(const TrainingSetup& s) const override { return s.optimizer == OptimizerKind::Adafactor; }
  void persistent(const StepContext& c, MemoryBreakdown& b) const override {
    b.optimizer_states = adafactor_state_bytes(c.model, c.setup);
  }
  // Per tensor: update = grad**2 + eps (two alive while the sum is made), then for a matrix R x C the row/column
  // factors (R + C) and their product (R x C) beside update; finally -update beside update. Pure bf16 also
  // upcasts the gradient and the parameter to fp32 for the whole step of the tensor.
  std::optional<int64_t> step_temporaries(const StepContext& c) const override {
    const TrainingSetup& s = c.setup;
    if (flat_partitions(s)) return (2 * C(zero_shard(trainable_parameter_count(c.model, s), s, 1)) * 4).get();
    const bool upcast = s.precision == Precision::Bf16Pure;
    int64_t largest = 0;
    for (const auto& t : trainable_tensor_shapes(c.model, s)) {
      const C n = t.elements();
      C bytes = t.cols == 0 ? 2 * n * 4 : (2 * n + t.rows + t.cols) * 4;
      if (upcast) bytes += 2 * n * 4;
      largest = std::max(largest, bytes.get());
    }
    return largest;
  }
};

}  // namespace

int64_t adafactor_state_bytes(const ModelSpec& m, const TrainingSetup& s) {
  // transformers' Adafactor keeps its states in the gradient's dtype after the fp32 upcast: fp32.
  if (flat_partitions(s)) return (4 * C(zero_shard(trainable_parameter_count(m, s), s, 1)) + 4).get();
  C bytes = 0;
  for (const auto& t : trainable_tensor_shapes(m, s)) {
    const C per = t.cols == 0 ? C(t.rows) : C(t.rows) + t.cols;  // exp_avg_sq, or exp_avg_sq_row + _col
    bytes += C(t.count) * (4 * per + 4);                           // + the 'RMS' scalar tensor
  }
  return bytes.get();
}

const SetupFeature& adafactor_feature() {
  static const AdafactorFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
