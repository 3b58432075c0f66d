// Every byte autograd saves in the forward (see activations.h). Each term was measured on Hugging Face
// GPT-2 and Llama models with torch 2.11 (bench/estimator_validation/FINDINGS.md has the derivations):
// the estimate is exact bookkeeping of saved tensors, not a fitted constant. For reference, Korthikanti
// et al. 2022 count 34·s·b·h + 5·a·s²·b bytes per block for GPT-3 in 16 bits with eager attention; the
// terms below reduce to a similar count but follow the dtype each op really saves in.
#include "gpuops/estimator/activations.h"

#include <algorithm>
#include <memory>
#include <optional>

#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "features/setup_feature.h"
#include "forward_ops.h"

namespace gpuops::estimator {
namespace {

using C = CheckedInt;

// CPU RNG state a reentrant checkpoint saves per block (torch.get_rng_state(), host memory on CUDA).
constexpr int64_t kCpuRngStateBytes = 5056;

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

// One fused q|k|v linear with RoPE (Phi-3, LitGPT's code): q and k are rotated into new tensors while v stays a
// view of the linear's output, so the v that SDPA or flash saves keeps the whole output alive, its q and k parts
// too. LitGPT with fewer k/v heads than q heads expands k and v and reshapes them (copies: v is no view), keeping
// two full-width copies instead. Measured on the CPU against Llama of the same shape, SDPA, frozen weights: HF
// Phi-3 2 N·h more per layer with as many k/v heads as q heads and 1.25 N·h with a quarter; LitGPT 0.5.3's GPT
// 2 N·h and 1.5 N·h. Eager attention is not measured.
C fused_qkv_extra(const ModelSpec& m, const Shape& x) {
  if (!m.fused_qkv || m.learned_positions) return 0;
  if (m.kv_expanded_copies && m.num_kv_heads != m.num_heads)
    return 2 * x.N * (x.a - m.num_kv_heads) * x.d * x.e;
  return x.N * (x.a + m.num_kv_heads) * x.d * x.e;
}

// A mixture-of-experts MLP (transformers 4.57's MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, DeepseekV2MoE):
// each token goes through experts_per_token experts, so k·N rows pass through expert MLPs of width
// moe_intermediate_size; experts no token picked save nothing. Counted relative to the dense MLP's norm.
C moe_mlp_bytes(const ModelSpec& m, const Shape& x) {
  const C k = m.experts_per_token, E = m.num_experts, Im = m.moe_intermediate_size;
  const C S = m.shared_expert_intermediate_size, Nh = x.N * x.h;
  // Per routed row (listed with saved_tensors_hooks on transformers 4.57's Mixtral and Qwen2-MoE blocks, fp32):
  // its gathered input (under autocast the 16-bit casts expert gate and up make), gate, up, act(gate),
  // product, the expert output the routing weight multiplies, the weighted output index_add_ keeps (residual
  // dtype), the row's token and top-k slot indices (int64) and its routing weight.
  const C input = x.mode == Numerics::Autocast ? 2 * x.h * 2 : x.h * x.r;
  C bytes = k * x.N * (input + 4 * Im * x.e + x.h * x.e + x.h * x.r + 16 + x.r);
  bytes += x.N * E * 4 + x.N * k * 8;  // router: fp32 softmax over experts, top-k indices
  if (m.norm_topk_prob) bytes += x.N * k * 4 + x.N * 4;  // renormalised: the fp32 top-k weights and their sum
  if (m.router_fp32 && x.mode == Numerics::Half) bytes += Nh * 4 + E * x.h * 4;  // DeepSeek's fp32 router inputs
  if (S > 0) bytes += 4 * x.N * S * x.e;  // shared experts: one SwiGLU MLP on every token
  if (m.shared_expert_gate) bytes += Nh * x.e + x.N * x.e;  // sigmoid(gate) times the shared output: both saved
  if (x.mode == Numerics::Autocast) {  // the norm is read by the router, shared gate/up and their gate
    const int64_t consumers = 1 + (m.shared_expert_intermediate_size > 0 ? 2 : 0) + (m.shared_expert_gate ? 1 : 0);
    bytes = bytes + C(consumers) * Nh * 2 - C(mlp_input_consumers(m)) * Nh * 2;
  }
  return bytes;
}

// Weights of the block linears (experts included) of `layers` of the model's blocks: exact when every block
// is alike, the mean block otherwise (DeepSeek's first dense layers).
C linear_weights_of_layers(const ModelSpec& m, int64_t layers) {
  C n = 0;
  for (const auto& g : block_linears(m)) n += C(g.count) * g.shape.in_features * g.shape.out_features;
  return layers == m.num_layers ? n : n / m.num_layers * layers;
}

}  // namespace

Shape shape_of(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  Shape x{};
  x.mode = t.precision == Precision::Fp32 ? Numerics::Fp32
           : residual_stream_bytes(t) == 2 ? Numerics::Half
                                           : Numerics::Autocast;
  x.b = t.micro_batch, x.s = t.seq_len, x.N = x.b * x.s;
  x.h = m.hidden_size, x.V = m.vocab_size, x.i = m.intermediate_size, x.L = m.num_layers;
  x.a = m.num_heads, x.d = effective_head_dim(m);
  x.e = compute_dtype_bytes(t.precision);
  x.r = x.mode == Numerics::Half ? 2 : 4;
  x.cpu = dev.is_cpu();
  x.mask = x.cpu ? x.e : 1;
  x.amp = is_mixed(t.precision) && t.amp == AmpLayout::Autocast;
  return x;
}

int64_t mlp_input_consumers(const ModelSpec& m) { return m.mlp == MlpKind::SwiGlu && !m.fused_gate_up ? 2 : 1; }

C attention_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x, bool cpu_mask_per_block,
                  bool fused_view) {
  const C qkv_and_out = 4 * x.Nq() * x.e;  // q, k, v (expanded to every head), output-projection input
  const C lse = x.b * x.a * x.s * 4;         // flash kernels' fp32 log-sum-exp per row
  // Gemma-2's attn_logit_softcapping: tanh(scores / cap) * cap saves the tanh output, one more s x s tensor.
  const C softcap = m.attn_logit_softcapping > 0 ? x.scores() * x.e : C(0);
  if (t.attention == AttentionKind::Eager) return qkv_and_out + eager_scores_bytes(m, x) + softcap;
  if (sdpa_math_path(m, t, x)) return 3 * x.Nq() * 4 + 3 * x.scores() * 4 + x.Nq() * x.e;
  const C view = fused_view ? fused_qkv_extra(m, x) : C(0);
  if (t.attention == AttentionKind::Sdpa && x.cpu)  // + the materialised causal mask
    return qkv_and_out + (cpu_mask_per_block ? x.b * x.s * x.s * x.e : C(0)) + lse + view;
  return qkv_and_out + lse + view;  // flash, or SDPA on CUDA (is_causal, no mask)
}

// ---- The eager model.

C ForwardOps::norm(const ModelSpec& m, const Shape& x, int64_t consumers) const {
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

C ForwardOps::attention(const ModelSpec& m, const TrainingSetup& t, const Shape& x) const {
  return attention_bytes(m, t, x, true, true);
}

C ForwardOps::mlp(const ModelSpec& m, const Shape& x) const {
  // SwiGLU: gate, up, silu(gate), product. GELU: its input and output, plus gelu_new's 3 intermediates.
  const C saved = m.mlp == MlpKind::SwiGlu ? 4 : (m.composite_gelu ? 5 : 2);
  return saved * x.N * x.i * x.e;
}

// Both norms (Gemma-2's post-norms too) and the residual dropout masks.
C ForwardOps::block_other(const ModelSpec& m, const TrainingSetup&, const Shape& x) const {
  const int64_t qkv_consumers = m.fused_qkv ? 1 : 3;
  C bytes = norm(m, x, qkv_consumers) + norm(m, x, mlp_input_consumers(m));
  if (m.norms_per_layer > 2) bytes += (m.norms_per_layer - 2) * norm(m, x, 0);
  if (m.dropout) bytes += 2 * x.N * x.h * x.mask;
  return bytes;
}

C ForwardOps::first_block_unsaved(const ModelSpec&, const TrainingSetup&, const Shape&) const { return 0; }

C ForwardOps::rope_tables(const Shape& x) const { return 2 * x.s * x.d * (x.mode == Numerics::Half ? 2 : 4); }

C ForwardOps::shared_by_blocks(const TrainingSetup&, const Shape&, int64_t) const { return 0; }

// Autocast caches a 16-bit copy of every weight it casts during a forward with grad enabled; mm saves it, so it
// lives until the backward.
C ForwardOps::autocast_copies(const ModelSpec& m, const TrainingSetup&, const Shape& x, int64_t layers) const {
  if (x.mode != Numerics::Autocast) return 0;
  const bool head = has_lm_head(m);
  return 2 * ((head ? x.V * x.h : 0) + linear_weights_of_layers(m, layers));
}

C ForwardOps::outer_extras(const ModelSpec&, const TrainingSetup&, const Shape&) const { return 0; }

C ForwardOps::final_norm(const ModelSpec& m, const Shape& x) const { return norm(m, x, 1); }

// The fp32 log-softmax, the shifted int64 labels, the loss.
C ForwardOps::loss(const Shape& x, int64_t logit_bytes) const { return x.N * x.V * logit_bytes + x.N * 8 + 4; }

const ForwardOps& eager_ops() {
  static const ForwardOps ops;
  return ops;
}

ForwardSaved forward_saved(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  ForwardSaved f;
  if (m.family == ModelFamily::ParamsOnly) return f;  // no architecture: nothing is modelled
  const Shape x = shape_of(m, t, dev);
  const std::vector<const SetupFeature*> features = features_of(t);
  // What the ops save: the eager model, wrapped by each feature that changes it (compile, LoRA).
  std::vector<std::unique_ptr<ForwardOps>> wrappers;
  const ForwardOps* ops = &eager_ops();
  for (const SetupFeature* feature : features)
    if (auto wrapped = feature->forward_ops(t, *ops)) ops = wrappers.emplace_back(std::move(wrapped)).get();

  const C Nh = x.N * x.h;
  f.inputs = (x.N * 8).get();
  const C attention = ops->attention(m, t, x);
  const C mlp = ops->mlp(m, x);
  f.block_attention = attention.get();
  f.block_mlp = mlp.get();
  f.block_other = ops->block_other(m, t, x).get();
  const C block = attention + mlp + f.block_other;

  // Which blocks the forward checkpoints (features/checkpointing.cpp): a checkpointed block keeps its input
  // hidden states and the CPU RNG state instead of its saved tensors.
  const int64_t L = m.num_layers;
  const auto checkpoints = [&](int64_t layer) {
    return std::any_of(features.begin(), features.end(),
                       [&](const SetupFeature* feature) { return feature->checkpoints_layer(t, layer, L); });
  };
  int64_t checkpointed = 0;
  for (int64_t layer = 0; layer < L; ++layer) checkpointed += checkpoints(layer) ? 1 : 0;
  f.last_block_checkpointed = L > 0 && checkpoints(L - 1);
  const int64_t rng = x.cpu ? kCpuRngStateBytes : 0;
  f.layers = (checkpointed * (Nh * x.r + rng) + (L - checkpointed) * block).get();
  if (checkpointed == 0) f.layers = (C(f.layers) - ops->first_block_unsaved(m, t, x)).get();
  if (moe_layer_count(m) > 0) {  // MoE blocks save the routed experts' tensors instead of a dense MLP's
    const C moe = moe_mlp_bytes(m, x);
    int64_t whole_moe = 0;  // MoE blocks not checkpointed
    for (int64_t layer = 0; layer < L; ++layer) whole_moe += is_moe_layer(m, layer) && !checkpoints(layer) ? 1 : 0;
    f.layers = (checkpointed * (Nh * x.r + rng) + (L - checkpointed - whole_moe) * block +
                whole_moe * (block - mlp + moe)).get();
    if (is_moe_layer(m, L - 1)) f.block_mlp = moe.get();
  }

  // Outside the blocks.
  C extras = m.learned_positions ? x.s * 8 : ops->rope_tables(x);  // position ids, or RoPE's cos and sin
  extras += ops->shared_by_blocks(t, x, checkpointed);
  if (m.dropout) extras += Nh * (x.cpu ? x.r : 1);  // embedding dropout mask
  if (m.family == ModelFamily::Encoder) extras += ops->norm(m, x, 3);  // BERT's embedding LayerNorm
  extras += ops->outer_extras(m, t, x);
  extras += ops->autocast_copies(m, t, x, L - checkpointed);  // checkpointed blocks run without grad
  f.extras = extras.get();

  // The head: the final norm (or BERT's MLM transform: + dense input, GELU input) and the loss.
  if (m.family == ModelFamily::Decoder) f.final_norm = ops->final_norm(m, x).get();
  if (m.masked_lm_head) f.final_norm = (ops->norm(m, x, 1) + 2 * Nh * x.e).get();
  if (has_lm_head(m)) {
    std::optional<int64_t> own;  // a loss feature's (chunked: the same; fused linear CE: no logits at all)
    const StepContext context{m, t, dev};
    for (const SetupFeature* feature : features)
      if (const auto bytes = feature->loss_saved(context)) own = bytes;
    if (own) {
      f.loss = *own;
    } else {
      f.loss = ops->loss(x, loss_logit_bytes(t)).get();
      if (m.final_logit_softcapping > 0) f.loss = (C(f.loss) + x.N * x.V * x.e).get();  // Gemma-2: tanh(logits / cap)
    }
  }
  for (const SetupFeature* feature : features) feature->forward(m, t, x, f);
  f.total();  // the sum must fit too
  return f;
}

int64_t residual_stream_bytes(const TrainingSetup& t) {
  if (t.precision == Precision::Fp32) return 4;
  if (runs_in_16_bits(t)) return 2;
  const std::vector<const SetupFeature*> on = features_of(t);  // a 16-bit LoRA base under autocast
  return std::any_of(on.begin(), on.end(), [&](const SetupFeature* f) { return f->stream_in_16_bits(t); }) ? 2 : 4;
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

int64_t mlp_backward_bytes(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  if (m.family == ModelFamily::ParamsOnly || is_moe_layer(m, m.num_layers - 1)) return 0;
  const Shape x = shape_of(m, t, dev);
  return (2 * x.N * x.i * x.e).get();
}

}  // namespace gpuops::estimator
