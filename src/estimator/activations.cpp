// Every byte autograd saves in the forward (see activations.h). Each term was measured on Hugging Face
// GPT-2 and Llama models with torch 2.11 (bench/estimator_validation/FINDINGS.md has the derivations):
// the estimate is exact bookkeeping of saved tensors, not a fitted constant. For reference, Korthikanti
// et al. 2022 count 34·s·b·h + 5·a·s²·b bytes per block for GPT-3 in 16 bits with eager attention; the
// terms below reduce to a similar count but follow the dtype each op really saves in.
#include "gpuops/estimator/activations.h"

#include "gpuops/estimator/estimate.h"

namespace gpuops::estimator {
namespace {

// Every size below is a CheckedInt: products of batch, sequence and model sizes throw SizeOverflow
// instead of wrapping (estimate_memory names the argument).
using C = CheckedInt;

// CPU RNG state a reentrant checkpoint saves per block (torch.get_rng_state(), host memory on CUDA).
constexpr int64_t kCpuRngStateBytes = 5056;

// How a block's tensors are typed: all fp32, autocast (fp32 residual stream, 16-bit matmuls), or 16-bit.
enum class Numerics { Fp32, Autocast, Half };

// The sizes the terms are written in, for one micro-batch.
struct Shape {
  Numerics mode;
  C N, h, V, i, L;  // tokens, hidden, vocab, MLP width, layers
  C b, s, a, d;     // batch, sequence, heads, head width
  C e;              // compute dtype bytes (matmul outputs)
  C r;              // residual-stream / norm-input dtype bytes
  C mask;           // dropout mask bytes: the input dtype on the CPU, 1-byte bool on CUDA
  bool cpu;
  C Nq() const { return N * a * d; }          // q (and k, v after GQA expansion) elements
  C scores() const { return b * a * s * s; }  // one attention matrix for all heads
};

Shape shape_of(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  Shape x{};
  // A LoRA base in 16 bits makes the residual stream 16-bit even under autocast.
  const bool half = runs_in_16_bits(t) || (t.lora.rank > 0 && t.precision != Precision::Fp32);
  x.mode = t.precision == Precision::Fp32 ? Numerics::Fp32 : half ? Numerics::Half : Numerics::Autocast;
  x.b = t.micro_batch, x.s = t.seq_len, x.N = x.b * x.s;
  x.h = m.hidden_size, x.V = m.vocab_size, x.i = m.intermediate_size, x.L = m.num_layers;
  x.a = m.num_heads, x.d = effective_head_dim(m);
  x.e = compute_dtype_bytes(t.precision);
  x.r = x.mode == Numerics::Half ? 2 : 4;
  x.cpu = dev.is_cpu();
  x.mask = x.cpu ? x.e : 1;
  return x;
}

// A norm's saved tensors; `consumers` linears read its output (each casts it to 16 bits under autocast).
C norm_bytes(const ModelSpec& m, const Shape& x, int64_t consumers) {
  const C Nh = x.N * x.h;
  if (m.norm == NormKind::RmsNorm) {  // fp32 input copy, rsqrt per token, normed, weighted output
    switch (x.mode) {
      case Numerics::Fp32: return 3 * Nh * 4 + x.N * 4;
      case Numerics::Autocast: return 2 * Nh * 4 + x.N * 4 + consumers * Nh * 2;
      case Numerics::Half: return Nh * 4 + x.N * 4 + 2 * Nh * 2;
    }
  }
  switch (x.mode) {  // LayerNorm: input, mean and rstd per token, output
    case Numerics::Fp32: return 2 * Nh * 4 + 2 * x.N * 4;
    case Numerics::Autocast: return Nh * 4 + 2 * x.N * 4 + consumers * Nh * 2;
    case Numerics::Half: return 2 * Nh * 2 + 2 * x.N * 2;
  }
  return 0;
}

// Eager attention's s x s tensors: the softmax output (fp32 under autocast or with an fp32 upcast), its
// 16-bit cast, or with dropout the mask and the dropped probabilities instead of the cast.
C eager_scores_bytes(const ModelSpec& m, const Shape& x) {
  const C softmax = (x.mode != Numerics::Half || m.softmax_upcast) ? 4 : 2;
  const C extra = m.attention_dropout ? x.mask + x.e : (softmax != x.e ? x.e : 0);
  return x.scores() * (softmax + extra);
}

// Which SDPA path runs: the CPU falls back to the math path (fp32, s x s) when attention dropout is on.
bool sdpa_math_path(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  return t.attention == AttentionKind::Sdpa && x.cpu && m.attention_dropout;
}

C block_attention_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const C qkv_and_out = 4 * x.Nq() * x.e;  // q, k, v (expanded to every head), output-projection input
  const C lse = x.b * x.a * x.s * 4;         // flash kernels' fp32 log-sum-exp per row
  if (t.attention == AttentionKind::Eager) return qkv_and_out + eager_scores_bytes(m, x);
  if (sdpa_math_path(m, t, x)) return 3 * x.Nq() * 4 + 3 * x.scores() * 4 + x.Nq() * x.e;
  if (t.attention == AttentionKind::Sdpa && x.cpu) return qkv_and_out + x.b * x.s * x.s * x.e + lse;  // + mask
  return qkv_and_out + lse;  // flash, or SDPA on CUDA (is_causal, no mask)
}

C block_mlp_bytes(const ModelSpec& m, const Shape& x) {
  // SwiGLU: gate, up, silu(gate), product. GELU: its input and output, plus gelu_new's 3 intermediates.
  const C saved = m.mlp == MlpKind::SwiGlu ? 4 : (m.composite_gelu ? 5 : 2);
  return saved * x.N * x.i * x.e;
}

// The rest of a block: both norms, residual dropout masks, LoRA's low-rank intermediates.
C block_other_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const int64_t qkv_consumers = m.fused_qkv ? 1 : 3, mlp_consumers = m.mlp == MlpKind::SwiGlu ? 2 : 1;
  C bytes = norm_bytes(m, x, qkv_consumers) + norm_bytes(m, x, mlp_consumers);
  if (m.dropout) bytes += 2 * x.N * x.h * x.mask;
  // Each adapter saves x·A for B's gradient; frozen linears are counted as saving their inputs (conservative).
  if (t.lora.rank > 0) bytes += static_cast<int64_t>(t.lora.targets.size()) * x.N * t.lora.rank * x.e;
  return bytes;
}

C linear_weights_per_layer(const ModelSpec& m) {
  C n = 0;
  for (const auto& p : projection_names(m)) {
    const LinearShape l = projection_shape(m, p);
    n += C(l.in_features) * l.out_features;
  }
  return n;
}

}  // namespace

ForwardSaved forward_saved(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  ForwardSaved f;
  if (m.family == ModelFamily::ParamsOnly) return f;  // no architecture: nothing is modelled
  const Shape x = shape_of(m, t, dev);
  const C Nh = x.N * x.h;
  f.inputs = (x.N * 8).get();
  const C attention = block_attention_bytes(m, t, x), mlp = block_mlp_bytes(m, x);
  f.block_attention = attention.get();
  f.block_mlp = mlp.get();
  const C block = attention + mlp + block_other_bytes(m, t, x);

  // Checkpointing (reentrant, as Hugging Face's gradient_checkpointing_enable): a checkpointed block
  // keeps its input hidden states and the CPU RNG state; every k-th block from the first is checkpointed.
  const int64_t L = m.num_layers;
  int64_t checkpointed = 0;
  if (t.checkpoint == CheckpointKind::Full) checkpointed = L;
  if (t.checkpoint == CheckpointKind::EveryK) checkpointed = ceil_div(L, t.checkpoint_every_k);
  f.last_block_checkpointed = t.checkpoint == CheckpointKind::Full ||
                              (t.checkpoint == CheckpointKind::EveryK && (L - 1) % t.checkpoint_every_k == 0);
  const int64_t rng = x.cpu ? kCpuRngStateBytes : 0;
  f.layers = (checkpointed * (Nh * x.r + rng) + (L - checkpointed) * block).get();

  // Outside the blocks.
  C extras = 0;
  if (checkpointed > 0) {  // the attention mask is a checkpoint input, alive until the backward
    if (t.attention == AttentionKind::Eager) extras += x.b * x.s * x.s * x.r;  // additive, model dtype
    if (t.attention == AttentionKind::Sdpa && x.cpu) extras += x.b * x.s * x.s;  // bool
  }
  if (m.learned_positions) {
    extras += x.s * 8;  // position ids
  } else {              // RoPE cos and sin, and with checkpointing the position ids and a scalar
    extras += 2 * x.s * x.d * (x.mode == Numerics::Half ? 2 : 4);
    if (checkpointed > 0) extras += x.s * 8 + 4;
  }
  if (m.dropout) extras += Nh * (x.cpu ? x.r : 1);  // embedding dropout mask
  if (m.family == ModelFamily::Encoder) extras += norm_bytes(m, x, 3);  // BERT's embedding LayerNorm
  // Autocast caches a 16-bit copy of every weight it casts during a forward with grad enabled; mm saves
  // it, so it lives until the backward. Checkpointed blocks run their forward without grad.
  if (x.mode == Numerics::Autocast && t.lora.rank == 0) {
    const bool head = m.family == ModelFamily::Decoder || m.masked_lm_head;
    extras += 2 * ((head ? x.V * x.h : 0) + (L - checkpointed) * linear_weights_per_layer(m));
  }
  f.extras = extras.get();

  // The head: the final norm (or BERT's MLM transform), the fp32 log-softmax the loss saves, the
  // shifted int64 labels and the loss value.
  if (m.family == ModelFamily::Decoder) f.final_norm = norm_bytes(m, x, 1).get();
  if (m.masked_lm_head) f.final_norm = (norm_bytes(m, x, 1) + 2 * Nh * x.e).get();  // + dense input, GELU input
  if (m.family == ModelFamily::Decoder || m.masked_lm_head) f.loss = (x.N * x.V * 4 + x.N * 8 + 4).get();
  f.total();  // the sum must fit too
  return f;
}

int64_t attention_backward_bytes(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  if (m.family == ModelFamily::ParamsOnly) return 0;
  const Shape x = shape_of(m, t, dev);
  if (t.attention == AttentionKind::Eager || sdpa_math_path(m, t, x)) {
    // Score-sized gradients alive together: softmax and its input gradient, with fp32 copies unless the
    // scores are 16-bit end to end; fitted on the two measured fp32 dropout cases (FINDINGS.md).
    int64_t per_score = (x.mode == Numerics::Fp32 || (x.mode == Numerics::Half && !m.softmax_upcast)) ? 8 : 6;
    if (m.attention_dropout && x.mode == Numerics::Fp32) per_score = 16;
    return (per_score * x.scores() + 3 * x.Nq() * x.e).get();
  }
  return (6 * x.Nq() * x.e).get();  // gradients of q, k, v, before and after folding the GQA expansion
}

}  // namespace gpuops::estimator
