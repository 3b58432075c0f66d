// Optimizer offload (TrainingSetup::offload_optimizer): DeepSpeed's ZeRO-Offload, or gpuops' ZeroOptimizer(
// offload="cpu") with its flags (zero_reduce_at_step / zero_bucket_bytes; its device side: gpuops_zero12.cpp).
// The host holds the optimizer states, the fp32 master partition and the fp32 gradient partition the CPU
// optimizer reads, and runs the step; the device keeps the model's weights.
#include "gpuops/errors.h"
#include "gpuops/estimator/state_layout.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

class OffloadFeature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec&) const override {
    if (!on(s)) return;
    const bool gpuops_zero = s.zero_reduce_at_step || s.zero_bucket_bytes > 0;
    GPUOPS_CHECK_ARG(s.optimizer == OptimizerKind::AdamW || s.optimizer == OptimizerKind::Adam ||
                         s.optimizer == OptimizerKind::SgdMomentum || s.optimizer == OptimizerKind::Adafactor ||
                         (s.optimizer == OptimizerKind::GpuopsAdamW8bit && gpuops_zero),
                     "offload-optimizer with optimizer {} is not accepted ({}); accepted: adamw, adam, sgd-momentum, "
                     "adafactor, and gpuops-adamw-8bit with gpuops' ZeroOptimizer (--zero-reduce)",
                     to_string(s.optimizer),
                     s.optimizer == OptimizerKind::Sgd               ? "plain SGD has no state to offload"
                     : s.optimizer == OptimizerKind::GpuopsAdamW8bit ? "gpuops offloads it through its ZeroOptimizer"
                                                                     : "bitsandbytes' optimizers step on the GPU");
    GPUOPS_CHECK_ARG(s.sharding != ShardingLayout::Fsdp2 && s.sharding != ShardingLayout::Fsdp1,
                     "offload-optimizer models DeepSpeed's ZeRO-Offload (flat partitions); FSDP's CPU offload also "
                     "offloads the parameters and is not modelled; accepted: sharding flat");
  }
  bool on(const TrainingSetup& s) const override { return s.offload_optimizer; }
  void place(const StepContext& c, MemoryBreakdown& b) const override {
    const int64_t local = sharded_trainable_elements(c.model, c.setup, 1);
    b.host_memory = (C(b.host_memory) + b.optimizer_states + 4 * C(local) + 4 * C(local)).get();
    b.optimizer_states = 0;
    b.master_weights = 0;
  }
  std::optional<int64_t> step_temporaries(const StepContext&) const override { return 0; }  // on the CPU
  void moments(const StepContext& c, const MomentTerms&, Moments& moments) const override {
    // DeepSpeed's gradients are on the host by the step; gpuops' ZeroOptimizer (gpuops_zero12.cpp) models its own.
    if (c.setup.zero_reduce_at_step || c.setup.zero_bucket_bytes > 0) return;
    moment(moments, StepPhase::OptimizerStep).gradients = 0;
  }
};

}  // namespace

const SetupFeature& offload_feature() {
  static const OffloadFeature feature;
  return feature;
}

}  // namespace gpuops::estimator
