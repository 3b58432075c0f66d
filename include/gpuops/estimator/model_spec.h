#pragma once
// The architecture the estimator reasons about: the handful of config.json fields that decide the parameter
// count and the activation sizes. Torch-free.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/checked_int.h"

namespace gpuops::estimator {

/// Decoder: causal LM with an LM head (GPT-2, Llama, Mistral, Qwen2). Encoder: BERT. ParamsOnly: a bare
/// parameter count (no architecture, so no activation model).
enum class ModelFamily { Decoder, Encoder, ParamsOnly };
/// Gelu: up and down matrices with GELU between (GPT-2, BERT). SwiGlu: gate, up, down (Llama family).
enum class MlpKind { Gelu, SwiGlu };
enum class NormKind { LayerNorm, RmsNorm };

/// One transformer architecture, in Hugging Face config.json terms.
struct ModelSpec {
  std::string name;
  ModelFamily family = ModelFamily::Decoder;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       ///< key/value heads (GQA); equal to num_heads for multi-head attention
  int64_t head_dim = 0;           ///< 0: hidden_size / num_heads (config.json's optional head_dim)
  int64_t intermediate_size = 0;  ///< MLP width
  int64_t max_positions = 0;      ///< max_position_embeddings / n_positions
  MlpKind mlp = MlpKind::Gelu;
  NormKind norm = NormKind::LayerNorm;
  bool tied_embeddings = false;   ///< LM head shares the token embedding matrix
  bool learned_positions = false; ///< a position-embedding table (GPT-2, BERT) instead of RoPE
  bool linear_bias = false;       ///< every attention and MLP linear has a bias (GPT-2, BERT)
  bool qkv_bias = false;          ///< only q, k, v have a bias (Qwen2)
  bool dropout = false;           ///< dropout on embeddings and the residual stream (saves masks)
  bool attention_dropout = false; ///< dropout on the attention probabilities (saves s x s masks)
  bool fused_qkv = false;         ///< q, k and v come from one linear (GPT-2's c_attn): one saved input
  bool kv_expanded_copies = false;  ///< grouped k and v expanded to every head as copies, not views (LitGPT's code)
  bool composite_gelu = false;    ///< GELU written as tensor ops (GPT-2's gelu_new): 3 more saved intermediates
  bool softmax_upcast = false;    ///< eager attention's softmax runs in fp32 and is cast back (Llama family)
  bool causal_mask_buffers = false;  ///< a bool max_positions x max_positions causal mask per layer (GPT-2)
  bool masked_lm_head = false;    ///< Encoder only: BertForMaskedLM head instead of BertModel's pooler
  int64_t type_vocab_size = 0;    ///< BERT token-type embeddings
  int64_t explicit_param_count = 0;  ///< ParamsOnly: the count itself (trainable)
  int64_t fixed_bytes = 0;  ///< ParamsOnly: bytes held as stored and never trained (a live module's frozen
                            ///< parameters, buffers and quantised tensors), on every device, unsharded

  // --- Model families (Gemma-2, Phi-3, MoE, MLA; docs/estimator.md "Model families") ---
  std::string model_type;         ///< config.json's model_type ("" for presets written by hand)
  std::string mlp_activation;     ///< a gated MLP's activation: "" or "silu" (SwiGLU), "gelu_pytorch_tanh" (GeGLU)
  int64_t norms_per_layer = 2;    ///< norms inside a block: 4 for Gemma-2 (pre and post, around both halves)
  bool o_bias = false;            ///< the attention output projection has a bias (Llama's attention_bias)
  bool mlp_bias = false;          ///< gate, up and down (and every expert's) have biases (mlp_bias)
  bool fused_gate_up = false;     ///< gate and up are one linear (Phi-3's gate_up_proj): one saved input
  bool scaled_embeddings = false; ///< embeddings multiplied by sqrt(hidden_size) (Gemma): nothing saved
  int64_t sliding_window = 0;     ///< sliding-window attention width (0: none); memory is the same
  double attn_logit_softcapping = 0;   ///< tanh cap on the attention scores (Gemma-2), 0: none
  double final_logit_softcapping = 0;  ///< tanh cap on the logits (Gemma-2), 0: none
  // Mixture of experts: a MoE layer's MLP is a router, num_experts routed experts of which each token uses
  // experts_per_token, and optionally shared experts every token uses.
  int64_t num_experts = 0;        ///< routed experts per MoE layer; 0: a dense model
  int64_t experts_per_token = 0;  ///< top-k
  int64_t moe_intermediate_size = 0;            ///< width of one routed expert's SwiGLU MLP
  int64_t shared_expert_intermediate_size = 0;  ///< width of the shared expert MLP (all shared experts), 0: none
  bool shared_expert_gate = false;  ///< Qwen2-MoE: a sigmoid gate (hidden_size -> 1) on the shared expert
  bool router_fp32 = false;         ///< DeepSeek: router logits from fp32 copies of its input and weight
  bool norm_topk_prob = false;      ///< top-k weights renormalised (Mixtral always; norm_topk_prob): 2 more saved
  std::vector<bool> moe_layers;     ///< one entry per layer, true where the MLP is MoE; empty: all dense
  // Multi-head latent attention (DeepSeek-V2/V3), used when kv_lora_rank > 0.
  int64_t q_lora_rank = 0;          ///< 0: q_proj; else q_a_proj, q_a_layernorm, q_b_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  /// Human-readable assumptions made when reading the config (printed as notes, in --json, in Python).
  std::vector<std::string> assumptions;
};

/// Shape of one linear layer inside a transformer block.
struct LinearShape {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = false;
  int64_t parameters() const { return (CheckedInt(in_features) * out_features + (bias ? out_features : 0)).get(); }
};

/// Parameter counts by group: what LoRA, quantisation, ZeRO-3 gathering and the activation model need.
struct ParameterGroups {
  int64_t embeddings = 0;           ///< token (+position, +token-type) tables and BERT's embedding LayerNorm
  int64_t attention_per_layer = 0;  ///< q, k, v, o weights and biases
  int64_t mlp_per_layer = 0;        ///< MLP weights and biases
  int64_t norms_per_layer = 0;      ///< the two norms of a block
  int64_t final_norm = 0;           ///< decoders' last norm
  int64_t head = 0;                 ///< untied LM head, BERT pooler or BERT MLM head (transform + decoder bias)
  int64_t num_layers = 0;
  int64_t moe_layers = 0;           ///< layers whose MLP is moe_mlp_per_layer instead of mlp_per_layer
  int64_t moe_mlp_per_layer = 0;    ///< router, every routed expert, shared experts and their gate
  /// The largest block (a MoE block when there is one).
  int64_t per_layer() const {
    return (CheckedInt(attention_per_layer) + (moe_layers > 0 ? moe_mlp_per_layer : mlp_per_layer) +
            norms_per_layer).get();
  }
  int64_t total() const {
    const CheckedInt common = CheckedInt(attention_per_layer) + norms_per_layer;
    return (CheckedInt(embeddings) + CheckedInt(num_layers) * common +
            (CheckedInt(num_layers) - moe_layers) * mlp_per_layer + CheckedInt(moe_layers) * moe_mlp_per_layer +
            final_norm + head).get();
  }
};

/// Effective attention head width: head_dim if set, else hidden_size / num_heads.
int64_t effective_head_dim(const ModelSpec& spec);

/// Names of the projections of one block: q, k, v, o, then gate, up, down (SwiGLU) or up, down (GELU). MLA
/// attention has q (or q_a, q_b), kv_a, kv_b, o instead of q, k, v, o. A MoE model lists only its attention
/// projections (the LoRA targets it accepts). Phi-3's fused qkv_proj / gate_up_proj are named by their slices.
std::vector<std::string> projection_names(const ModelSpec& spec);

/// Number of MoE layers (0 for a dense model), and whether layer `i` is one.
int64_t moe_layer_count(const ModelSpec& spec);
bool is_moe_layer(const ModelSpec& spec, int64_t layer);

/// True for multi-head latent attention (DeepSeek-V2/V3: kv_lora_rank > 0).
bool is_mla(const ModelSpec& spec);

/// True for a model with a language-model head: a decoder, or an encoder with BERT's masked-LM head.
inline bool has_lm_head(const ModelSpec& spec) { return spec.family == ModelFamily::Decoder || spec.masked_lm_head; }

/// One kind of linear layer inside the blocks and how many of it the whole model has (layers x experts).
struct LinearGroup {
  std::string name;
  LinearShape shape;
  int64_t count = 0;
};

/// Every linear layer of the blocks (projections, experts, routers, shared experts), grouped by shape: what
/// quantisation, the autocast weight cache and the largest-weight transients need. Empty for ParamsOnly.
std::vector<LinearGroup> block_linears(const ModelSpec& spec);

/// Shape of projection `name` (one of projection_names()); ArgumentError for any other name.
LinearShape projection_shape(const ModelSpec& spec, std::string_view name);

/// Parameter counts by group (all zero but the total's source for ParamsOnly, see parameter_count).
ParameterGroups parameter_groups(const ModelSpec& spec);

/// Exact parameter count, as `sum(p.numel() for p in model.parameters())` of the Hugging Face class:
/// GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (tied weights counted once);
/// BertModel (with pooler) or, with masked_lm_head, BertForMaskedLM. ParamsOnly: explicit_param_count.
int64_t parameter_count(const ModelSpec& spec);

/// Training FLOPs per token, PaLM's count (Chowdhery et al. 2022, appendix B; torchtitan's too): 6 per parameter
/// (forward 2, backward 4) over the parameters without the token embedding table (a lookup; a tied LM head's
/// matmul stays counted), plus 12·layers·heads·head_dim·seq_len for the attention scores and their product
/// with v. ArgumentError for a bare parameter count (no architecture) and for MoE models (their tokens use
/// experts_per_token of the experts: give the count yourself).
double training_flops_per_token(const ModelSpec& spec, int64_t seq_len);

/// Number of parameter tensors (what per-parameter optimizer bookkeeping scales with); 0 for ParamsOnly.
int64_t parameter_tensor_count(const ModelSpec& spec);

/// Elements of the largest parameter tensor (embedding, LM head, or the widest linear); 0 for ParamsOnly.
int64_t largest_parameter_tensor(const ModelSpec& spec);

/// Throws ArgumentError naming the first field that is out of range (enums included), or the sizes whose
/// parameter count overflows 64 bits.
void validate(const ModelSpec& spec);

/// Parses a parameter count such as "7B", "1.5b", "125M", "350k", "2T", "6738415616" or "8e9" (>= 1):
/// decimal digits, an optional fraction and exponent, an optional suffix k, M, B (or G), T; nothing else
/// (no hex, sign, spaces, inf or nan).
int64_t parse_param_count(std::string_view text);

/// A ParamsOnly spec for a bare parameter count (no architecture: activations are not modelled).
ModelSpec params_only_model(int64_t count, std::string name = "");

std::string_view to_string(ModelFamily family);
std::string_view to_string(MlpKind mlp);
std::string_view to_string(NormKind norm);

}  // namespace gpuops::estimator
