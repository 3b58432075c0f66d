// Adafactor, paged optimizers, optimizer offload and FSDP2 (see state_layout.h). Sources of each term:
// docs/estimator.md, "Optimizers, offload and sharding".
#include "gpuops/estimator/state_layout.h"

#include <algorithm>

#include <fmt/format.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

bool is_paged(OptimizerKind o) { return o == OptimizerKind::PagedAdamW8bit || o == OptimizerKind::PagedAdamW32bit; }

bool is_fsdp2(const TrainingSetup& s) { return s.sharding == ShardingLayout::Fsdp2; }
bool is_gpuops(const TrainingSetup& s) { return s.sharding == ShardingLayout::Gpuops; }

// Bytes of trainable weights and gradients per element.
int64_t trainable_bytes(const TrainingSetup& s) { return runs_in_16_bits(s) ? 2 : 4; }

// A bitsandbytes Adam's states of one tensor of `n` values: 8-bit block-wise, or two fp32 states (the
// 32-bit optimizers allocate fp32 states whatever the parameter's dtype).
int64_t bnb_state_bytes(int64_t n, OptimizerKind o) {
  return o == OptimizerKind::PagedAdamW8bit ? eight_bit_adam_state_bytes(n) : (8 * C(n)).get();
}

// Flat ZeRO partitions (stage >= 1 with DeepSpeed's layout) hand the optimizer 1-D fp32 tensors.
bool flat_partitions(const TrainingSetup& s) { return s.zero_stage >= 1 && !is_fsdp2(s); }

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

void place_optimizer_state(const ModelSpec& m, const TrainingSetup& s, const DeviceProfile& device,
                           MemoryBreakdown& b) {
  if (s.offload_optimizer) {
    // ZeRO-Offload: the host holds the optimizer states, the fp32 master partition and the fp32 gradient
    // partition the CPU optimizer reads; the device keeps the model's weights.
    const int64_t local = sharded_trainable_elements(m, s, 1);
    b.host_memory = (C(b.host_memory) + b.optimizer_states + 4 * C(local) + 4 * C(local)).get();
    b.optimizer_states = 0;
    b.master_weights = 0;
    return;
  }
  if (!is_paged(s.optimizer) || device.is_cpu()) return;  // bitsandbytes does not page CPU tensors
  C on_device = 0, on_host = 0;
  for (const auto& t : trainable_tensor_shapes(m, s)) {
    const int64_t n = t.elements();
    (n >= kPagedMinElements ? on_host : on_device) += C(t.count) * bnb_state_bytes(n, s.optimizer);
  }
  b.optimizer_states = on_device.get();
  b.host_memory = (C(b.host_memory) + on_host).get();
}

std::optional<int64_t> state_step_temporaries(const ModelSpec& m, const TrainingSetup& s,
                                              const DeviceProfile& device) {
  if (s.offload_optimizer) return 0;  // the step runs on the CPU
  if (is_paged(s.optimizer)) {
    // Unified memory: the driver migrates the pages of the tensor being stepped back to the device; at
    // most the largest paged tensor's states are resident at once when the device is under pressure.
    if (device.is_cpu()) return 0;
    int64_t largest = 0;
    for (const auto& t : trainable_tensor_shapes(m, s))
      if (t.elements() >= kPagedMinElements) largest = std::max(largest, bnb_state_bytes(t.elements(), s.optimizer));
    return largest;
  }
  if (s.optimizer != OptimizerKind::Adafactor) return std::nullopt;
  // Per tensor: update = grad**2 + eps (two alive while the sum is made), then for a matrix R x C the
  // row/column factors (R + C) and their product (R x C) beside update; finally -update beside update.
  // Pure bf16 also upcasts the gradient and the parameter to fp32 for the whole step of the tensor.
  if (flat_partitions(s)) return (2 * C(zero_shard(trainable_parameter_count(m, s), s, 1)) * 4).get();
  const bool upcast = s.precision == Precision::Bf16Pure;
  int64_t largest = 0;
  for (const auto& t : trainable_tensor_shapes(m, s)) {
    const C n = t.elements();
    C bytes = t.cols == 0 ? 2 * n * 4 : (2 * n + t.rows + t.cols) * 4;
    if (upcast) bytes += 2 * n * 4;
    largest = std::max(largest, bytes.get());
  }
  return largest;
}

namespace {

// gpuops' ZeroOptimizer(stage=3) (zero_units.cpp): unit 0 (embeddings, final norm, head) is gathered for the
// forward and again from the loss's backward to the end; each block is gathered for its forward and backward
// with zero_prefetch more launched ahead (all blocks from forward to backward without reshard_after_forward).
// A unit's full gradient buffer (the parameters' dtype) lives from its first gradient to its reduction: unit 0's
// from the head's gradient to the end of the backward, a block's through its backward. A 16-bit unit is reduced
// through an fp32 copy of its gradient; over Gloo (the CPU) a reduce-scatter works on a clone of its input and
// an all-gather on a copy of its output.
int64_t gpuops_units_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) {
  const ParameterGroups g = parameter_groups(m);
  const int64_t wb = trainable_bytes(s);
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

}  // namespace

int64_t gpuops_head_bytes(const ModelSpec& m, const TrainingSetup& s) {
  if (s.sharding != ShardingLayout::Gpuops || s.num_gpus == 1) return 0;
  const ParameterGroups g = parameter_groups(m);
  const C root = (C(g.embeddings) + g.final_norm + g.head) * trainable_bytes(s);
  const C head_grad = C(m.vocab_size) * m.hidden_size * trainable_bytes(s);  // copied into the buffer, then freed
  const C blocks = s.reshard_after_forward ? C(0) : C(m.num_layers) * g.per_layer() * trainable_bytes(s);
  return (2 * root + head_grad + blocks).get();  // unit 0 gathered, its gradient buffer
}

int64_t unsharded_bytes(const ModelSpec& m, const TrainingSetup& s, StepPhase phase) {
  if (s.zero_stage < 3 || s.num_gpus == 1 || m.family == ModelFamily::ParamsOnly) return 0;
  const ParameterGroups g = parameter_groups(m);
  const bool lora = s.lora.rank > 0;
  const int64_t wb = lora ? 2 : trainable_bytes(s);  // gathered weights: the frozen base is 16-bit
  const C block = C(g.per_layer()) * wb;
  const bool backward = phase == StepPhase::LossBackward || phase == StepPhase::AttentionBackward;
  if (is_gpuops(s)) return gpuops_units_bytes(m, s, phase);
  if (!is_fsdp2(s)) return backward ? (2 * block).get() : 0;  // DeepSpeed ZeRO-3: current + prefetched block

  // FSDP2. The root module (embeddings, final norm, head) keeps its unsharded parameters from its forward
  // to the end of the backward; the blocks reshard after forward unless reshard_after_forward is false.
  const C root = (C(g.embeddings) + g.final_norm + g.head) * wb;
  const int64_t gb = trainable_bytes(s);
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
  GPUOPS_CHECK_ARG(s.sharding == ShardingLayout::Flat || s.sharding == ShardingLayout::Fsdp2 || is_gpuops(s),
                   "sharding {} is out of range; accepted: flat, fsdp2, gpuops", static_cast<int>(s.sharding));
  GPUOPS_CHECK_ARG(s.zero_prefetch >= 0 && s.zero_prefetch <= 64, "zero-prefetch must be in [0, 64] units, got {}",
                   s.zero_prefetch);
  GPUOPS_CHECK_ARG(s.zero_prefetch == 1 || is_gpuops(s), "zero-prefetch applies to sharding gpuops only (its "
                   "ZeroOptimizer's prefetch); accepted: sharding gpuops, or zero-prefetch 1");
  if (is_gpuops(s)) {
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
    GPUOPS_CHECK_ARG(!s.offload_optimizer, "offload-optimizer is not built for sharding gpuops; accepted: sharding "
                     "flat (DeepSpeed's ZeRO-Offload)");
  }
  const bool params_only = m.family == ModelFamily::ParamsOnly;
  if (is_fsdp2(s)) {
    GPUOPS_CHECK_ARG(s.zero_stage == 3, "sharding fsdp2 shards weights, gradients and states (ZeRO stage 3); "
                     "accepted: zero 3 (or 0 on the command line and in Python, which means 3), got zero {}",
                     s.zero_stage);
    GPUOPS_CHECK_ARG(!params_only, "sharding fsdp2 needs an architecture (per-tensor dim-0 shards), not a bare "
                     "parameter count; accepted: sharding flat with params, or a preset / config.json");
  }
  GPUOPS_CHECK_ARG(!s.zero_reduce_at_step || ((s.zero_stage == 1 || s.zero_stage == 2) && !is_fsdp2(s)),
                   "zero-reduce step (gpuops' ZeroOptimizer) applies to ZeRO stages 1 and 2 with sharding flat; "
                   "accepted: zero 1 or 2, or zero-reduce backward; got zero {}{}", s.zero_stage,
                   is_fsdp2(s) ? " with sharding fsdp2" : "");
  GPUOPS_CHECK_ARG(s.zero_bucket_bytes >= 0, "zero-bucket-bytes must be >= 0 (0: buckets not counted), got {}",
                   s.zero_bucket_bytes);
  GPUOPS_CHECK_ARG(s.zero_bucket_bytes == 0 || ((s.zero_stage == 1 || s.zero_stage == 2) && !is_fsdp2(s) &&
                                                !s.zero_reduce_at_step && !params_only),
                   "zero-bucket-bytes (gpuops' ZeroOptimizer reducing in the backward) applies to ZeRO stages 1 and "
                   "2 with sharding flat, zero-reduce backward and an architecture; accepted: 0 otherwise, got zero "
                   "{}, zero-reduce {}{}", s.zero_stage, s.zero_reduce_at_step ? "step" : "backward",
                   params_only ? ", a bare parameter count" : "");
  GPUOPS_CHECK_ARG(s.reduce_dtype == ReduceDtype::Grad || is_fsdp2(s),
                   "reduce-dtype {} applies to sharding fsdp2 only (MixedPrecisionPolicy); accepted: sharding fsdp2, "
                   "or reduce-dtype grad", to_string(s.reduce_dtype));
  GPUOPS_CHECK_ARG(s.reshard_after_forward || is_fsdp2(s) || is_gpuops(s),
                   "reshard-after-forward false applies to sharding fsdp2 and gpuops only; accepted: sharding fsdp2 or "
                   "gpuops, or reshard-after-forward true");
  if (s.optimizer == OptimizerKind::Adafactor) {
    GPUOPS_CHECK_ARG(!params_only, "optimizer adafactor needs an architecture (its states depend on every "
                     "tensor's shape), not a bare parameter count; accepted: a preset or a config.json");
    GPUOPS_CHECK_ARG(!is_fsdp2(s), "optimizer adafactor does not run on FSDP2's DTensor parameters "
                     "(transformers' Adafactor mixes them with plain tensors); accepted with sharding flat");
  }
  if (is_paged(s.optimizer)) {
    GPUOPS_CHECK_ARG(!params_only, "optimizer {} needs an architecture (bitsandbytes pages the states of tensors "
                     "of >= {} values only), not a bare parameter count", to_string(s.optimizer),
                     kPagedMinElements);
    GPUOPS_CHECK_ARG(s.zero_stage == 0, "optimizer {} is modelled without ZeRO (a flat ZeRO partition or an FSDP2 "
                     "DTensor is not what bitsandbytes pages tensor by tensor); accepted: zero 0, got zero {}",
                     to_string(s.optimizer), s.zero_stage);
  }
  if (s.offload_optimizer) {
    GPUOPS_CHECK_ARG(s.optimizer == OptimizerKind::AdamW || s.optimizer == OptimizerKind::Adam ||
                         s.optimizer == OptimizerKind::SgdMomentum || s.optimizer == OptimizerKind::Adafactor,
                     "offload-optimizer with optimizer {} is not accepted ({}); accepted: adamw, adam, sgd-momentum, "
                     "adafactor", to_string(s.optimizer),
                     s.optimizer == OptimizerKind::Sgd ? "plain SGD has no state to offload"
                                                       : "bitsandbytes' optimizers step on the GPU");
    GPUOPS_CHECK_ARG(!is_fsdp2(s), "offload-optimizer models DeepSpeed's ZeRO-Offload (flat partitions); FSDP2's "
                     "CPUOffloadPolicy also offloads the parameters and is not modelled; accepted: sharding flat");
  }
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
