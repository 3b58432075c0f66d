// gpuops' own 8-bit AdamW (OptimizerKind::GpuopsAdamW8bit: gpuops.optim.AdamW(state_bits=8), gpuops/fused_adam8.h):
// per tensor of at least 4096 values, two 1-byte moments and two fp32 scales per 256 values; smaller tensors
// keep fp32 moments; every tensor a 0-d fp32 step counter on the parameters' device. One fused pass: no step
// temporaries. docs/estimator.md, "Optimizers, offload and sharding".
#include "gpuops/errors.h"
#include "gpuops/estimator/param_tensors.h"
#include "setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// gpuops/fused_adam8.h's kMin8BitNumel and kStateBlock (the estimator is torch-free: the numbers, not the header).
constexpr int64_t kMin8BitNumel = 4096, kStateBlock = 256;

class GpuopsAdam8Feature final : public SetupFeature {
 public:
  void validate(const TrainingSetup& s, const ModelSpec& m) const override {
    if (!on(s)) return;
    GPUOPS_CHECK_ARG(m.family != ModelFamily::ParamsOnly, "optimizer gpuops-adamw-8bit needs an architecture "
                     "(tensors under {} values keep fp32 moments), not a bare parameter count; accepted: a preset "
                     "or a config.json", kMin8BitNumel);
    GPUOPS_CHECK_ARG(s.zero_stage == 0, "optimizer gpuops-adamw-8bit: gpuops' ZeroOptimizer does not shard 8-bit "
                     "states yet; accepted: zero 0, got zero {}", s.zero_stage);
    GPUOPS_CHECK_ARG(!s.offload_optimizer, "optimizer gpuops-adamw-8bit is not modelled with --offload-optimizer "
                     "(gpuops has no optimizer offload yet)");
  }
  bool on(const TrainingSetup& s) const override { return s.optimizer == OptimizerKind::GpuopsAdamW8bit; }
  void persistent(const StepContext& c, MemoryBreakdown& b) const override {
    // Small tensors' fp32 moments are float32 whatever the parameters' dtype (the fused step's masters and
    // moments are fp32).
    C bytes = 0;
    for (const auto& t : trainable_tensor_shapes(c.model, c.setup)) {
      const C n = t.elements();
      const C moments = n >= kMin8BitNumel ? 2 * (n + 4 * ((n + kStateBlock - 1) / kStateBlock)) : 8 * n;
      bytes += C(t.count) * (moments + 4);
    }
    b.optimizer_states = bytes.get();
  }
  std::optional<int64_t> step_temporaries(const StepContext&) const override { return 0; }
};

}  // namespace

const SetupFeature& gpuops_adam8_feature() {
  static const GpuopsAdam8Feature feature;
  return feature;
}

}  // namespace gpuops::estimator
