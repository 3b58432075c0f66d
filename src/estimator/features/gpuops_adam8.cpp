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
    GPUOPS_CHECK_ARG(s.zero_stage <= 2, "optimizer gpuops-adamw-8bit is modelled without ZeRO and with gpuops' "
                     "ZeroOptimizer at stages 1 and 2 (stage 3's per-unit buffers are not modelled yet); accepted: "
                     "zero 0, 1 or 2, got zero {}", s.zero_stage);

  }
  bool on(const TrainingSetup& s) const override { return s.optimizer == OptimizerKind::GpuopsAdamW8bit; }
  void persistent(const StepContext& c, MemoryBreakdown& b) const override {
    // Small tensors' fp32 moments are float32 whatever the parameters' dtype (the fused step's masters and
    // moments are fp32).
    const auto& s = c.setup;
    if (s.zero_stage >= 1) {
      b.optimizer_states = sharded_bytes(c.model, s);
      return;
    }
    C bytes = 0;
    for (const auto& t : trainable_tensor_shapes(c.model, s)) {
      const C n = t.elements();
      const C moments = n >= kMin8BitNumel ? 2 * (n + 4 * ((n + kStateBlock - 1) / kStateBlock)) : 8 * n;
      bytes += C(t.count) * (moments + 4);
    }
    b.optimizer_states = bytes.get();
  }

 private:
  // gpuops' ZeroOptimizer (stages 1-2, zero_optimizer.h's StateBlocks): the tensors of 4096 values or more in a
  // flat buffer of their own, each starting on a 256-value block, the buffer padded to whole blocks per rank
  // (2 code bytes per value and two fp32 scales per block on each rank); the smaller ones in another, each
  // starting on 16 bytes, padded to a multiple of the GPU count (8 bytes of fp32 moments per value); every rank
  // one fp32 step counter per tensor. Exact while each kind fits one bucket (zero_bucket_bytes, 25 MiB by
  // default); each further bucket adds under 256 x num_gpus values of padding.
  static int64_t sharded_bytes(const ModelSpec& m, const TrainingSetup& s) {
    const int64_t n_gpus = s.num_gpus, align = 16 / trainable_element_bytes(s);
    C blocked = 0, small = 0, tensors = 0;
    for (const auto& t : trainable_tensor_shapes(m, s)) {
      const int64_t n = t.elements();
      if (n >= kMin8BitNumel) {
        blocked += C(t.count) * (ceil_div(n, kStateBlock) * kStateBlock);
      } else {
        small += C(t.count) * (ceil_div(n, align) * align);
      }
      tensors += t.count;
    }
    const C blocks_per_rank = ceil_div(blocked.get(), kStateBlock * n_gpus);
    const C small_per_rank = ceil_div(small.get(), align * n_gpus) * align;
    return (blocks_per_rank * (2 * kStateBlock + 8) + small_per_rank * 8 + tensors * 4).get();
  }
  std::optional<int64_t> step_temporaries(const StepContext&) const override { return 0; }
};

}  // namespace

const SetupFeature& gpuops_adam8_feature() {
  static const GpuopsAdam8Feature feature;
  return feature;
}

}  // namespace gpuops::estimator
