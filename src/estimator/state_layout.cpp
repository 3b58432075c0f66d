// Adafactor, paged optimizers, optimizer offload and FSDP2 (see state_layout.h). Sources of each term:
// docs/estimator.md, "Optimizers, offload and sharding".
#include "gpuops/estimator/state_layout.h"

#include <algorithm>

#include <fmt/format.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

bool is_fsdp2(const TrainingSetup& s) { return s.sharding == ShardingLayout::Fsdp2; }

// LoRA adapter parameters inside one block, and outside the blocks (lm_head, embed).
C block_adapter_params(const ModelSpec& m, const LoraSetup& lora) {
  C n = 0;
  for (const auto& t : lora.targets) {
    if (is_outer_lora_target(t)) continue;
    const LinearShape l = projection_shape(m, t);
    n += lora.rank * (C(l.in_features) + l.out_features);
  }
  return n;
}

C outer_adapter_params(const ModelSpec& m, const LoraSetup& lora) {
  C n = 0;
  for (const auto& t : lora.targets) {
    if (!is_outer_lora_target(t)) continue;
    const LinearShape l = outer_lora_shape(m, t);
    n += lora.rank * (C(l.in_features) + l.out_features);
  }
  return n;
}

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

int64_t sharded_trainable_elements(const ModelSpec& m, const TrainingSetup& s, int from_stage) {
  if (!is_fsdp2(s) || s.zero_stage < from_stage) return zero_shard(trainable_parameter_count(m, s), s, from_stage);
  C n = 0;
  for (const auto& t : trainable_tensor_shapes(m, s)) n += C(t.count) * fsdp2_shard_elements(t, s.num_gpus);
  return n.get();
}

int64_t sharded_frozen_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.lora.rank == 0) return 0;
  if (!is_fsdp2(s)) return zero_shard(frozen_weight_bytes(m, s), s, 3);
  C bytes = 0;
  for (const auto& t : model_tensor_shapes(m)) {
    const bool quantised = is_quantised_base(s.lora.base) && (t.quantisable || (t.lm_head && s.lora.quantize_lm_head));
    // A quantised weight is a flat uint8 tensor to FSDP2 (bitsandbytes' Params4bit / Int8Params).
    const int64_t shard = quantised ? ceil_div(quantised_weight_bytes(t.cols, t.rows, s.lora.base), s.num_gpus)
                                    : (2 * C(fsdp2_shard_elements(t, s.num_gpus))).get();
    bytes += C(t.count) * shard;
  }
  return bytes.get();
}

int64_t unsharded_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) {
  if (s.zero_stage < 3 || s.num_gpus == 1 || m.family == ModelFamily::ParamsOnly) return 0;
  const ParameterGroups g = parameter_groups(m);
  const bool lora = s.lora.rank > 0;
  const int64_t wb = lora ? 2 : trainable_element_bytes(s);  // gathered weights: the frozen base is 16-bit
  const C block = C(g.per_layer()) * wb;
  const bool backward = phase == StepPhase::LossBackward || phase == StepPhase::AttentionBackward;
  if (s.sharding == ShardingLayout::Gpuops) {  // features/gpuops_stage3.cpp
    C bytes = 0;
    for (const SetupFeature* f : features_of(s)) bytes += f->gathered_bytes(m, s, phase);
    return bytes.get();
  }
  if (!is_fsdp2(s)) return backward ? (2 * block).get() : 0;  // DeepSpeed ZeRO-3: current + prefetched block

  // FSDP2. The root module (embeddings, final norm, head) keeps its unsharded parameters from its forward
  // to the end of the backward; the blocks reshard after forward unless reshard_after_forward is false.
  const C root = (C(g.embeddings) + g.final_norm + g.head) * wb;
  const int64_t gb = trainable_element_bytes(s);
  const C block_trainable = lora ? block_adapter_params(m, s.lora) : C(g.per_layer());
  const C root_trainable = lora ? outer_adapter_params(m, s.lora) : C(g.embeddings) + g.final_norm + g.head;
  const C block_grads = block_trainable * gb, root_grads = root_trainable * gb;
  const C all_blocks = C(m.num_layers) * block;
  // Each group's post-backward copies its unsharded gradients into one reduce-scatter input in reduce_dtype
  // (torch's foreach_reduce), both alive during the copy; the input stays until the next group's reduction.
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

void validate_state_options(const TrainingSetup& s, const ModelSpec& m) {
  const bool gpuops = s.sharding == ShardingLayout::Gpuops;
  GPUOPS_CHECK_ARG(s.sharding == ShardingLayout::Flat || s.sharding == ShardingLayout::Fsdp2 || gpuops,
                   "sharding {} is out of range; accepted: flat, fsdp2, gpuops", static_cast<int>(s.sharding));
  const bool params_only = m.family == ModelFamily::ParamsOnly;
  if (is_fsdp2(s)) {
    GPUOPS_CHECK_ARG(s.zero_stage == 3, "sharding fsdp2 shards weights, gradients and states (ZeRO stage 3); "
                     "accepted: zero 3 (or 0 on the command line and in Python, which means 3), got zero {}",
                     s.zero_stage);
    GPUOPS_CHECK_ARG(!params_only, "sharding fsdp2 needs an architecture (per-tensor dim-0 shards), not a bare "
                     "parameter count; accepted: sharding flat with params, or a preset / config.json");
  }
  GPUOPS_CHECK_ARG(s.reduce_dtype == ReduceDtype::Grad || is_fsdp2(s),
                   "reduce-dtype {} applies to sharding fsdp2 only (MixedPrecisionPolicy); accepted: sharding fsdp2, "
                   "or reduce-dtype grad", to_string(s.reduce_dtype));
  GPUOPS_CHECK_ARG(s.reshard_after_forward || is_fsdp2(s) || gpuops,
                   "reshard-after-forward false applies to sharding fsdp2 and gpuops only; accepted: sharding fsdp2 or "
                   "gpuops, or reshard-after-forward true");
  const LoraSetup& lora = s.lora;
  if (lora.quantize_lm_head) {
    GPUOPS_CHECK_ARG(lora.rank > 0 && is_quantised_base(lora.base),
                     "quantize-lm-head needs a quantised LoRA base; accepted with lora-rank >= 1 and base-dtype "
                     "int8, nf4 or nf4-nodq, got lora-rank {} and base-dtype {}", lora.rank, to_string(lora.base));
    GPUOPS_CHECK_ARG(m.family == ModelFamily::Decoder && !m.tied_embeddings,
                     "quantize-lm-head needs an untied LM head; model '{}' has {}; accepted: a decoder with "
                     "tie_word_embeddings false", m.name,
                     m.family == ModelFamily::Decoder ? "its LM head tied to the embeddings" : "no separate LM head");
  }
}

}  // namespace gpuops::estimator
