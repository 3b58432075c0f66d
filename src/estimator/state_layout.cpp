// Quantised and 8-bit sizes, and the local shares of a sharded layout (see state_layout.h). Sources of each
// term: docs/estimator.md, "Optimizers, offload and sharding".
#include "gpuops/estimator/state_layout.h"

#include "gpuops/estimator/estimate.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {
namespace {
using C = CheckedInt;
}  // namespace

bool is_quantised_base(BaseWeightDtype d) {
  return d == BaseWeightDtype::Int8 || d == BaseWeightDtype::Nf4 || d == BaseWeightDtype::Nf4NoDq;
}

int64_t quantised_weight_bytes(int64_t in_features, int64_t out_features, BaseWeightDtype dtype) {
  const int64_t n = (C(in_features) * out_features).get();
  switch (dtype) {
    case BaseWeightDtype::Fp16:
    case BaseWeightDtype::Bf16: return (2 * C(n)).get();
    case BaseWeightDtype::Fp32: return (4 * C(n)).get();
    case BaseWeightDtype::Int8: return (n + 4 * C(out_features)).get();  // LLM.int8: fp32 scale per output row
    // NF4 (QLoRA): 4 bits per value and one absmax per 64 values; double quantisation stores the absmax in
    // 8 bits with one fp32 constant per 256 of them, without it each absmax is fp32.
    case BaseWeightDtype::Nf4: return (ceil_div(n, 2) + C(ceil_div(n, 64)) + 4 * C(ceil_div(n, 64 * 256))).get();
    case BaseWeightDtype::Nf4NoDq: return (ceil_div(n, 2) + 4 * C(ceil_div(n, 64))).get();
  }
  return 0;
}

int64_t eight_bit_adam_state_bytes(int64_t n) { return (2 * C(n) + 2 * 4 * ceil_div(n, 2048)).get(); }

// The layout's local share (features/fsdp2.cpp), else the flat partitions.
int64_t sharded_trainable_elements(const ModelSpec& m, const TrainingSetup& s, int from_stage) {
  for (const SetupFeature* f : features_of(s))
    if (const auto local = f->local_trainable_elements(m, s, from_stage)) return *local;
  return zero_shard(trainable_parameter_count(m, s), s, from_stage);
}

int64_t sharded_frozen_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (!model_frozen(s)) return 0;  // no frozen base (features/lora.cpp)
  for (const SetupFeature* f : features_of(s))
    if (const auto local = f->local_frozen_bytes(m, s)) return *local;
  return zero_shard(frozen_weight_bytes(m, s), s, 3);
}

int64_t unsharded_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) {
  if (s.zero_stage < 3 || s.num_gpus == 1 || m.family == ModelFamily::ParamsOnly) return 0;
  C bytes = 0;  // the layout's own (features/zero3_flat.cpp, fsdp2.cpp, gpuops_stage3.cpp)
  for (const SetupFeature* f : features_of(s)) bytes += f->gathered_bytes(m, s, phase);
  return bytes.get();
}

}  // namespace gpuops::estimator
