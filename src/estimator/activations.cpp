// Every byte autograd saves in the forward (see activations.h). Each term was measured on Hugging Face
// GPT-2 and Llama models with torch 2.11 (bench/estimator_validation/FINDINGS.md has the derivations):
// the estimate is exact bookkeeping of saved tensors, not a fitted constant. For reference, Korthikanti
// et al. 2022 count 34·s·b·h + 5·a·s²·b bytes per block for GPT-3 in 16 bits with eager attention; the
// terms below reduce to a similar count but follow the dtype each op really saves in.
#include "gpuops/estimator/activations.h"

#include <algorithm>
#include <optional>

#include "gpuops/estimator/estimate.h"
#include "gpuops/estimator/param_tensors.h"
#include "activation_shape.h"
#include "features/setup_feature.h"

namespace gpuops::estimator {

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
  x.compiled = t.compile;
  x.amp = is_mixed(t.precision) && t.amp == AmpLayout::Autocast;
  x.peft = t.lora.rank > 0 && !t.compile;
  return x;
}

namespace {

// Every size below is a CheckedInt: products of batch, sequence and model sizes throw SizeOverflow
// instead of wrapping (estimate_memory names the argument).
using C = CheckedInt;

// CPU RNG state a reentrant checkpoint saves per block (torch.get_rng_state(), host memory on CUDA).
constexpr int64_t kCpuRngStateBytes = 5056;


// A norm's saved tensors; `consumers` linears read its output (each casts it to 16 bits under autocast).
C norm_bytes(const ModelSpec& m, const Shape& x, int64_t consumers) {
  const C Nh = x.N * x.h;
  if (x.compiled) {  // inductor: input, one output (its 16-bit cast under autocast, shared by readers), rstd
    switch (x.mode) {
      case Numerics::Fp32: return 2 * Nh * 4 + x.N * 4;
      case Numerics::Autocast: return Nh * 4 + Nh * 2 + x.N * 4;
      case Numerics::Half: return 2 * Nh * 2 + x.N * 4;
    }
  }
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

// One fused q|k|v linear with RoPE (Phi-3, LitGPT's code): q and k are rotated into new tensors while v stays a
// view of the linear's output, so the v that SDPA or flash saves keeps the whole output alive, its q and k parts
// too. LitGPT with fewer k/v heads than q heads expands k and v and reshapes them (copies: v is no view), keeping
// two full-width copies instead. Measured on the CPU against Llama of the same shape, SDPA, frozen weights: HF
// Phi-3 2 N·h more per layer with as many k/v heads as q heads and 1.25 N·h with a quarter; LitGPT 0.5.3's GPT
// 2 N·h and 1.5 N·h. Eager attention is not measured.
C fused_qkv_extra(const ModelSpec& m, const Shape& x) {
  if (!m.fused_qkv || m.learned_positions || x.compiled) return 0;
  if (m.kv_expanded_copies && m.num_kv_heads != m.num_heads)
    return 2 * x.N * (x.a - m.num_kv_heads) * x.d * x.e;
  return x.N * (x.a + m.num_kv_heads) * x.d * x.e;
}

C block_attention_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const C qkv_and_out = 4 * x.Nq() * x.e;  // q, k, v (expanded to every head), output-projection input
  const C lse = x.b * x.a * x.s * 4;         // flash kernels' fp32 log-sum-exp per row
  // Gemma-2's attn_logit_softcapping: tanh(scores / cap) * cap saves the tanh output, one more s x s tensor.
  const C softcap = m.attn_logit_softcapping > 0 ? x.scores() * x.e : C(0);
  if (t.attention == AttentionKind::Eager) return qkv_and_out + eager_scores_bytes(m, x) + softcap;
  if (sdpa_math_path(m, t, x)) return 3 * x.Nq() * 4 + 3 * x.scores() * 4 + x.Nq() * x.e;
  if (t.attention == AttentionKind::Sdpa && x.cpu)  // + mask (compiled: one shared mask, in extras)
    return qkv_and_out + (x.compiled ? C(0) : x.b * x.s * x.s * x.e) + lse + fused_qkv_extra(m, x);
  return qkv_and_out + lse + fused_qkv_extra(m, x);  // flash, or SDPA on CUDA (is_causal, no mask)
}

C block_mlp_bytes(const ModelSpec& m, const Shape& x) {
  // SwiGLU: gate, up, silu(gate), product. GELU: its input and output, plus gelu_new's 3 intermediates.
  const C saved = m.mlp == MlpKind::SwiGlu ? 4 : (m.composite_gelu ? 5 : 2);
  if (x.compiled) return (m.mlp == MlpKind::SwiGlu ? 3 : 2) * x.N * x.i * x.e;  // inductor recomputes silu / GELU
  return saved * x.N * x.i * x.e;
}

// Linears that read the MLP's input norm (each casts it to 16 bits under autocast): gate and up, or one.
int64_t mlp_input_consumers(const ModelSpec& m) { return m.mlp == MlpKind::SwiGlu && !m.fused_gate_up ? 2 : 1; }

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

// ---- Activation-side setups (docs/estimator.md, "Checkpointing policies, chunked loss, LoRA dropout,
// torch.compile").

// PEFT's lora_dropout > 0: each block target's dropout(x) is a new N x in tensor that lora_A's matmul
// saves, plus its mask (the input dtype on the CPU, a 1-byte bool on CUDA).
C lora_dropout_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const auto names = projection_names(m);
  C bytes = 0;
  for (const auto& target : t.lora.targets)
    if (std::find(names.begin(), names.end(), target) != names.end())
      bytes += x.N * projection_shape(m, target).in_features * (x.e + x.mask);
  return bytes;
}

// The loss's saved bytes (Hugging Face's cross-entropy): the fp32 log-softmax, the shifted int64 labels, the
// loss; compiled, the logits in the compute dtype, two fp32 values per row and labels padded by one per
// sequence. A loss feature (features/) may compute its own instead.
C loss_bytes(const Shape& x) {
  if (x.compiled) return x.N * x.V * x.e + 2 * x.N * 4 + x.b * (x.s + 1) * 8 + 4;
  return x.N * x.V * 4 + x.N * 8 + 4;
}

// ---- LoRA as PEFT runs it (docs/estimator.md, "What the forward saves"; FINDINGS.md, "LoRA (PEFT)"):
// the base is frozen, so a base linear saves no input (its weight gradient is never made) and a norm with a
// frozen weight keeps only what its input gradient needs. Listed with saved_tensors_hooks on transformers
// 4.57 + PEFT 0.18 Llama and GPT-2 blocks (fp32, bf16 base under autocast with fp32 adapters, pure bf16).

bool lora_targets(const TrainingSetup& t, std::string_view p) {
  return std::find(t.lora.targets.begin(), t.lora.targets.end(), p) != t.lora.targets.end();
}

// RMSNorm: its fp32 input (a copy when the stream is 16-bit) and rsqrt. LayerNorm: input, mean and rstd, in
// fp32 under autocast (which runs layer_norm in fp32).
C frozen_norm_bytes(const ModelSpec& m, const Shape& x) {
  if (m.norm == NormKind::RmsNorm) return x.N * x.h * 4 + x.N * 4;
  if (x.mode == Numerics::Half && !x.amp) return x.N * x.h * 2 + 2 * x.N * 2;
  return x.N * x.h * 4 + 2 * x.N * 4;
}

// The frozen MLP: SwiGLU keeps gate, up and silu(gate) (the product is down's input, saved only for an
// adapter); gelu_new keeps its input and 3 intermediates; a plain GELU its input.
C frozen_mlp_bytes(const ModelSpec& m, const Shape& x) {
  const C saved = m.mlp == MlpKind::SwiGlu ? 3 : (m.composite_gelu ? 4 : 1);
  return saved * x.N * x.i * x.e;
}

// Eager attention without the output projection's input (a frozen o saves none; an o adapter counts it).
C frozen_attention_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const C full = block_attention_bytes(m, t, x);
  return t.attention == AttentionKind::Eager ? full - x.Nq() * x.e : full;
}

// PEFT's dropout mask element: the adapter dtype on the CPU (fp32 adapters under autocast), a bool on CUDA.
C lora_dropout_mask_bytes(const Shape& x) { return x.cpu ? (x.amp ? C(4) : x.e) : C(1); }

// The adapters of one block: B saves x·A (N x r); A saves its input. Without dropout and autocast the
// targets reading one tensor share it: the attention norm's output (q, k, v), the MLP norm's output (gate,
// up), the MLP product (down); o reads SDPA's output, which the kernel saves already (eager: its own copy).
// Under autocast every A casts its input to 16 bits itself (PEFT casts x to the fp32 adapter dtype first):
// one copy per target, plus autocast's cached 16-bit A and B (extras). With lora_dropout each target keeps
// the dropout mask (the adapter dtype on the CPU, a bool on CUDA) and A's own input.
C lora_adapter_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const C mask = lora_dropout_mask_bytes(x);
  C bytes = 0;
  bool attention_input = false, mlp_input = false;
  for (const auto& p : projection_names(m)) {
    if (!lora_targets(t, p)) continue;
    const C in = projection_shape(m, p).in_features;
    bytes += x.N * t.lora.rank * x.e;
    if (t.lora_dropout > 0) {
      bytes += x.N * in * (x.e + mask);
    } else if (x.amp) {
      bytes += x.N * in * 2;
    } else if (p == "o") {
      if (t.attention == AttentionKind::Eager) bytes += x.N * in * x.e;
    } else if (p == "down") {
      bytes += x.N * in * x.e;
    } else {
      (p == "up" || p == "gate" ? mlp_input : attention_input) = true;
    }
  }
  if (attention_input) bytes += x.N * x.h * x.e;
  if (mlp_input) bytes += x.N * x.h * x.e;
  return bytes;
}

// What bitsandbytes keeps of a quantised base for its backward (BnbVersion, training_setup.h): the int8
// matmul keeps its input (every release) and before 0.45.0 an int8 transposed copy per linear; the 4-bit
// matmul keeps its input before 0.43.2; either only for an input that requires grad. Linears reading one
// tensor keep it once: the attention norm's output (q, k, v, MLA's q_a, kv_a), the MLP norm's output (gate,
// up). o reads the SDPA kernel's output, which the kernel saves already (eager: a copy of its own). An
// adapter without dropout or autocast saves the very tensor its base keeps (counted with the adapters). In
// the first block the block input does not require grad; the later inputs are counted as requiring it
// (they do once an attention adapter ran: the safe side).
struct BnbKeeps {
  bool input = false, int8_copy = false;
};
BnbKeeps bnb_keeps(const LoraSetup& lora) {
  const bool nf4 = lora.base == BaseWeightDtype::Nf4 || lora.base == BaseWeightDtype::Nf4NoDq;
  const bool int8 = lora.base == BaseWeightDtype::Int8;
  return {int8 || (nf4 && lora.bnb_version < BnbVersion{0, 43, 2}), int8 && lora.bnb_version < BnbVersion{0, 45, 0}};
}

C quantised_base_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x, bool first_block) {
  const BnbKeeps keeps = bnb_keeps(t.lora);
  if (!keeps.input) return 0;
  C bytes = 0;
  bool attention_input = false, mlp_input = false;    // a shared input is kept
  bool attention_saved = false, mlp_saved = false;    // ... and an adapter saves it already
  for (const auto& p : projection_names(m)) {
    const bool reads_attention_input = p == "q" || p == "k" || p == "v" || p == "q_a" || p == "kv_a";
    const bool reads_mlp_input = p == "gate" || p == "up";
    if (first_block && reads_attention_input) continue;
    const C in = projection_shape(m, p).in_features;
    if (keeps.int8_copy) bytes += x.N * in;
    const bool adapter_saves_it = lora_targets(t, p) && t.lora_dropout == 0 && !x.amp;
    if (reads_attention_input) {
      attention_input = true, attention_saved = attention_saved || adapter_saves_it;
    } else if (reads_mlp_input) {
      mlp_input = true, mlp_saved = mlp_saved || adapter_saves_it;
    } else if (!adapter_saves_it && (p != "o" || t.attention == AttentionKind::Eager)) {
      bytes += x.N * in * x.e;
    }
  }
  if (attention_input && !attention_saved) bytes += x.N * x.h * x.e;
  if (mlp_input && !mlp_saved) bytes += x.N * x.h * x.e;
  return bytes;
}

// The first block's input does not require grad (frozen embedding): nothing before its first adapter is
// saved. With checkpointing PEFT's enable_input_require_grads makes it require grad. Eager's q·kᵀ saves q
// only when k requires grad (a k adapter) and kᵀ only when q does (SDPA's kernel saves all three anyway).
// lora_dropout on the block's input (q, k, v adapters) saves no mask there, and under autocast A's 16-bit
// weight is not saved either (only x's gradient would need it).
C lora_first_block_unsaved(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  C unsaved = frozen_norm_bytes(m, x) + quantised_base_bytes(m, t, x, false) - quantised_base_bytes(m, t, x, true);
  for (const char* p : {"q", "k", "v"}) {
    if (!lora_targets(t, p)) continue;
    const C in = projection_shape(m, p).in_features;
    if (t.lora_dropout > 0) unsaved += x.N * in * lora_dropout_mask_bytes(x);
    if (x.amp) unsaved += 2 * C(t.lora.rank) * in;
  }
  if (!lora_targets(t, "q") && !lora_targets(t, "k") && !lora_targets(t, "v")) {  // attention out of the graph
    unsaved += frozen_attention_bytes(m, t, x);
    return lora_targets(t, "o") ? unsaved : unsaved + frozen_norm_bytes(m, x);
  }
  if (t.attention == AttentionKind::Eager && !m.fused_qkv) {
    if (!lora_targets(t, "k")) unsaved += x.Nq() * x.e;
    if (!lora_targets(t, "q")) unsaved += x.Nq() * x.e;
  }
  return unsaved;
}

// 16-bit copies autocast caches of the adapters of one block (A and B, r x (in + out) per target).
C lora_autocast_weights(const ModelSpec& m, const TrainingSetup& t) {
  C n = 0;
  for (const auto& p : projection_names(m))
    if (lora_targets(t, p)) n += C(t.lora.rank) * (C(projection_shape(m, p).in_features) + projection_shape(m, p).out_features);
  return 2 * n;
}

// The rest of a block: both norms, residual dropout masks, LoRA's low-rank intermediates.
C block_other_bytes(const ModelSpec& m, const TrainingSetup& t, const Shape& x) {
  const int64_t qkv_consumers = m.fused_qkv ? 1 : 3, mlp_consumers = mlp_input_consumers(m);
  if (x.peft) {  // frozen norms and the adapters (Gemma-2's post-norms: as frozen norms too)
    C bytes = C(std::max<int64_t>(m.norms_per_layer, 2)) * frozen_norm_bytes(m, x) + lora_adapter_bytes(m, t, x) +
              quantised_base_bytes(m, t, x, false);
    if (m.dropout) bytes += 2 * x.N * x.h * x.mask;
    return bytes;
  }
  C bytes = norm_bytes(m, x, qkv_consumers) + norm_bytes(m, x, mlp_consumers);
  if (m.norms_per_layer > 2) bytes += (m.norms_per_layer - 2) * norm_bytes(m, x, 0);  // Gemma-2's post-norms
  if (m.dropout) bytes += 2 * x.N * x.h * x.mask;
  // Each adapter saves x·A for B's gradient; frozen linears are counted as saving their inputs (conservative).
  if (t.lora.rank > 0) bytes += block_lora_target_count(t.lora) * x.N * t.lora.rank * x.e;
  if (t.lora_dropout > 0) bytes += lora_dropout_bytes(m, t, x);
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

ForwardSaved forward_saved(const ModelSpec& m, const TrainingSetup& t, const DeviceProfile& dev) {
  ForwardSaved f;
  if (m.family == ModelFamily::ParamsOnly) return f;  // no architecture: nothing is modelled
  const Shape x = shape_of(m, t, dev);
  const C Nh = x.N * x.h;
  f.inputs = (x.N * 8).get();
  const C attention = x.peft ? frozen_attention_bytes(m, t, x) : block_attention_bytes(m, t, x);
  const C mlp = x.peft ? frozen_mlp_bytes(m, x) : block_mlp_bytes(m, x);
  f.block_attention = attention.get();
  f.block_mlp = mlp.get();
  const C block = attention + mlp + block_other_bytes(m, t, x);

  // Which blocks the forward checkpoints (features/checkpointing.cpp): a checkpointed block keeps its input
  // hidden states and the CPU RNG state instead of its saved tensors.
  const int64_t L = m.num_layers;
  const std::vector<const SetupFeature*> features = features_of(t);
  const auto checkpoints = [&](int64_t layer) {
    return std::any_of(features.begin(), features.end(),
                       [&](const SetupFeature* feature) { return feature->checkpoints_layer(t, layer, L); });
  };
  int64_t checkpointed = 0;
  for (int64_t layer = 0; layer < L; ++layer) checkpointed += checkpoints(layer) ? 1 : 0;
  f.last_block_checkpointed = L > 0 && checkpoints(L - 1);
  const int64_t rng = x.cpu ? kCpuRngStateBytes : 0;
  f.layers = (checkpointed * (Nh * x.r + rng) + (L - checkpointed) * block).get();
  if (x.peft && checkpointed == 0) f.layers = (C(f.layers) - lora_first_block_unsaved(m, t, x)).get();
  if (moe_layer_count(m) > 0) {  // MoE blocks save the routed experts' tensors instead of a dense MLP's
    const C moe = moe_mlp_bytes(m, x);
    int64_t whole_moe = 0;  // MoE blocks not checkpointed
    for (int64_t layer = 0; layer < L; ++layer) whole_moe += is_moe_layer(m, layer) && !checkpoints(layer) ? 1 : 0;
    f.layers = (checkpointed * (Nh * x.r + rng) + (L - checkpointed - whole_moe) * block +
                whole_moe * (block - mlp + moe)).get();
    if (is_moe_layer(m, L - 1)) f.block_mlp = moe.get();
  }

  // Outside the blocks.
  C extras = 0;
  if (m.learned_positions) {
    extras += x.s * 8;  // position ids
  } else {              // RoPE cos and sin
    extras += x.compiled ? 2 * x.s * x.d : 2 * x.s * x.d * (x.mode == Numerics::Half ? 2 : 4);  // compiled: fp32 freqs
  }
  if (x.compiled && t.attention == AttentionKind::Sdpa && x.cpu && checkpointed < L) extras += x.b * x.s * x.s * x.e;
  if (m.dropout) extras += Nh * (x.cpu ? x.r : 1);  // embedding dropout mask
  if (m.family == ModelFamily::Encoder) extras += norm_bytes(m, x, 3);  // BERT's embedding LayerNorm
  // LoRA on lm_head / embed: B's matmul saves A's output, N x r (x·A; the embedding adapter's gather of
  // lora_embedding_A saves the ids, which are the inputs already counted).
  if (t.lora.rank > 0)
    extras += (static_cast<int64_t>(t.lora.targets.size()) - block_lora_target_count(t.lora)) * x.N * t.lora.rank * x.e;
  // A quantised LM head keeps its input like the block linears (quantised_base_bytes).
  if (x.peft && t.lora.quantize_lm_head) {
    const BnbKeeps keeps = bnb_keeps(t.lora);
    extras += (keeps.input ? Nh * x.e : C(0)) + (keeps.int8_copy ? Nh : C(0));
  }
  // Autocast caches a 16-bit copy of every weight it casts during a forward with grad enabled; mm saves
  // it, so it lives until the backward. Checkpointed blocks run their forward without grad.
  if (x.mode == Numerics::Autocast && t.lora.rank == 0) {
    const bool head = m.family == ModelFamily::Decoder || m.masked_lm_head;
    extras += 2 * ((head ? x.V * x.h : 0) + linear_weights_of_layers(m, L - checkpointed));
  }
  // LoRA under autocast: only the adapters are cached (a frozen weight's cast is not: it does not require grad).
  if (x.peft && x.amp) extras += C(L - checkpointed) * lora_autocast_weights(m, t);
  f.extras = extras.get();

  // The head: the final norm (or BERT's MLM transform), the fp32 log-softmax the loss saves, the
  // shifted int64 labels and the loss value.
  if (m.family == ModelFamily::Decoder) f.final_norm = (x.peft ? frozen_norm_bytes(m, x) : norm_bytes(m, x, 1)).get();
  // Compiled under autocast, the final norm keeps its input and output as 16-bit only (measured, docs).
  if (m.family == ModelFamily::Decoder && x.compiled && x.mode == Numerics::Autocast)
    f.final_norm = (2 * Nh * 2 + x.N * 4).get();
  if (m.masked_lm_head) f.final_norm = (norm_bytes(m, x, 1) + 2 * Nh * x.e).get();  // + dense input, GELU input
  if (m.family == ModelFamily::Decoder || m.masked_lm_head) {
    std::optional<int64_t> own;  // a loss feature's (chunked: the same; fused linear CE: no logits at all)
    const StepContext context{m, t, dev};
    for (const SetupFeature* feature : features_of(t))
      if (const auto bytes = feature->loss_saved(context)) own = bytes;
    if (own) {
      f.loss = *own;
    } else {
      f.loss = loss_bytes(x).get();
      if (m.final_logit_softcapping > 0) f.loss = (C(f.loss) + x.N * x.V * x.e).get();  // Gemma-2: tanh(logits / cap)
    }
  }
  for (const SetupFeature* feature : features) feature->forward(m, t, x, f);
  f.total();  // the sum must fit too
  return f;
}

int64_t residual_stream_bytes(const TrainingSetup& t) {
  // A LoRA base in 16 bits makes the residual stream 16-bit even under autocast.
  const bool half = runs_in_16_bits(t) ||
                    (t.lora.rank > 0 && t.precision != Precision::Fp32 && t.lora.base != BaseWeightDtype::Fp32);
  return t.precision != Precision::Fp32 && half ? 2 : 4;
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
