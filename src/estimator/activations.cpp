// Every activation, logit and temporary byte of the estimate (see activations.h). The per-layer model is
// Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": with 16-bit
// tensors and 1-byte dropout masks a block saves 34·s·b·h + 5·a·s²·b bytes. Here every term is written
// out so that it adapts to the dtype, GQA, SwiGLU, no-dropout models and flash attention; for GPT-2 in
// 16-bit with eager attention it reduces exactly to the paper's formula.
#include "gpuops/estimator/activations.h"

#include <algorithm>

#include "gpuops/estimator/estimate.h"

namespace gpuops::estimator {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Optimizer-step temporaries, which exist only after the activations have been freed.
int64_t step_temporaries(const ModelSpec& m, const TrainingSetup& s) {
  const int64_t local = zero_shard(trainable_parameter_count(m, s), s, 1);
  int64_t bytes = 0;
  // torch's default (foreach) Adam builds sqrt(exp_avg_sq) for the whole parameter list at once: one
  // state-sized buffer. A fused step (torch fused=True, gpuops §4, DeepSpeed FusedAdam) needs none; we stay
  // on the conservative side. Fused mixed-precision steps read the 16-bit gradients directly, so no fp32
  // gradient copy is counted. SGD and 8-bit AdamW (bitsandbytes kernels) update in place.
  if (s.optimizer == OptimizerKind::Adam || s.optimizer == OptimizerKind::AdamW)
    bytes += local * (s.precision == Precision::Bf16Pure ? 2 : 4);
  return bytes;
}

}  // namespace

ActivationBytes activation_bytes(const ModelSpec& m, const TrainingSetup& s) {
  ActivationBytes r;
  const int64_t step = step_temporaries(m, s);
  if (m.family == ModelFamily::ParamsOnly) {  // no architecture: only the optimizer step is known
    r.temporaries = step;
    return r;
  }
  const int64_t d = compute_dtype_bytes(s.precision);  // activations follow the compute dtype
  const int64_t mask = m.dropout ? 1 : 0;              // a dropout mask is 1 byte per element
  const bool eager = s.attention == AttentionKind::Eager;
  const int64_t b = s.micro_batch, sq = s.seq_len, h = m.hidden_size, a = m.num_heads;
  const int64_t inter = m.intermediate_size, hd = effective_head_dim(m);
  const int64_t q_width = a * hd;
  // Eager attention expands K and V to every head (HF's repeat_kv) before the matmuls that save them;
  // flash kernels take the grouped K and V as they are.
  const int64_t kv_width = eager ? q_width : m.num_kv_heads * hd;
  const int64_t tokens = b * sq;

  // --- one transformer block, everything saved ---
  // Attention: q/k/v input, Q, K, V, output-projection input (= the flash output it saves), dropout mask.
  int64_t attention = tokens * d * (h + q_width + 2 * kv_width + q_width) + tokens * h * mask;
  if (eager)  // softmax output, and with dropout its mask and the dropped copy: (2 + 1 + 2)·a·s²·b in 16-bit
    attention += a * sq * sq * b * (d + mask * (1 + d));
  else  // flash keeps only the fp32 log-sum-exp per row
    attention += a * tokens * 4;
  // MLP. GELU: input, GELU input, GELU output, dropout mask. SwiGLU: input, gate output (SiLU input),
  // up output, SiLU output, their product (down's input).
  const int64_t mlp = m.mlp == MlpKind::Gelu ? tokens * (h * d + 2 * inter * d + h * mask)
                                             : tokens * (h * d + 4 * inter * d);
  const int64_t norms = 2 * tokens * h * d;  // each norm saves its input
  // LoRA: each adapter saves its low-rank intermediate x·A for B's gradient. Frozen linears may skip
  // saving their inputs in torch; we keep the full-training count (conservative).
  const int64_t lora = s.lora.rank > 0 ? static_cast<int64_t>(s.lora.targets.size()) * tokens * s.lora.rank * d : 0;
  const int64_t per_layer = attention + mlp + norms + lora;
  const int64_t layer_input = tokens * h * d;

  // --- checkpointing: a checkpointed block keeps only its input; backward recomputes one block at a time ---
  const int64_t L = m.num_layers;
  int64_t layers = 0;
  switch (s.checkpoint) {
    case CheckpointKind::None: layers = L * per_layer; break;
    case CheckpointKind::Full: layers = L * layer_input + per_layer; break;
    case CheckpointKind::EveryK: {
      const int64_t checkpointed = ceil_div(L, s.checkpoint_every_k);  // layers 0, k, 2k, ...
      layers = checkpointed * layer_input + (L - checkpointed) * per_layer + per_layer;
      break;
    }
  }
  // Outside the blocks: embedding dropout mask; decoders' final-norm input and LM-head input; BERT's MLM
  // transform (dense input, GELU input, LayerNorm input).
  int64_t outside = tokens * h * mask;
  if (m.family == ModelFamily::Decoder) outside += 2 * tokens * h * d;
  if (m.family == ModelFamily::Encoder && m.masked_lm_head) outside += 3 * tokens * h * d;
  r.activations = layers + outside;

  // --- logits: b·s·V in the compute dtype, the fp32 log-softmax the loss saves, and its fp32 gradient ---
  if (m.family == ModelFamily::Decoder || m.masked_lm_head) r.logits = tokens * m.vocab_size * (d + 4 + 4);

  // --- backward's transient peak: gradient of the residual stream and of a block output, plus the two
  // largest intermediate gradients alive together (score matrix in eager attention, or MLP width) ---
  const int64_t mlp_width = m.mlp == MlpKind::SwiGlu ? 2 * inter : inter;
  int64_t backward = d * (2 * tokens * h + std::max(eager ? 2 * a * sq * sq * b : 0, 2 * tokens * mlp_width));
  // A quantised base weight is dequantised to 16-bit for each matmul (forward recompute and backward).
  if (s.lora.rank > 0 && (s.lora.base == BaseWeightDtype::Int8 || s.lora.base == BaseWeightDtype::Nf4)) {
    int64_t largest = 0;
    for (const auto& p : projection_names(m)) {
      const LinearShape l = projection_shape(m, p);
      largest = std::max(largest, l.in_features * l.out_features);
    }
    backward += 2 * largest;
  }
  // ZeRO-3 gathers a block's full weights before using it, and prefetches the next one.
  if (s.zero_stage >= 3 && s.num_gpus > 1) {
    const int64_t weight_bytes = s.lora.rank > 0 || s.precision != Precision::Fp32 ? 2 : 4;
    backward += 2 * parameter_groups(m).per_layer() * weight_bytes;
  }
  // The optimizer step runs after activations and logits are freed: it only counts by what it exceeds them.
  r.temporaries = std::max<int64_t>({backward, step - r.activations - r.logits, 0});
  return r;
}

}  // namespace gpuops::estimator
