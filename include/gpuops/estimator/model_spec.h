#pragma once
// The architecture the estimator reasons about: the handful of config.json fields that decide the parameter
// count and the activation sizes (design §7). Torch-free.

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
  bool composite_gelu = false;    ///< GELU written as tensor ops (GPT-2's gelu_new): 3 more saved intermediates
  bool softmax_upcast = false;    ///< eager attention's softmax runs in fp32 and is cast back (Llama family)
  bool causal_mask_buffers = false;  ///< a bool max_positions x max_positions causal mask per layer (GPT-2)
  bool masked_lm_head = false;    ///< Encoder only: BertForMaskedLM head instead of BertModel's pooler
  int64_t type_vocab_size = 0;    ///< BERT token-type embeddings
  int64_t explicit_param_count = 0;  ///< ParamsOnly: the count itself
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
  int64_t per_layer() const { return (CheckedInt(attention_per_layer) + mlp_per_layer + norms_per_layer).get(); }
  int64_t total() const {
    return (CheckedInt(embeddings) + CheckedInt(num_layers) * per_layer() + final_norm + head).get();
  }
};

/// Effective attention head width: head_dim if set, else hidden_size / num_heads.
int64_t effective_head_dim(const ModelSpec& spec);

/// Names of the projections of one block: q, k, v, o, then gate, up, down (SwiGLU) or up, down (GELU).
std::vector<std::string> projection_names(const ModelSpec& spec);

/// Shape of projection `name` (one of projection_names()); ArgumentError for any other name.
LinearShape projection_shape(const ModelSpec& spec, std::string_view name);

/// Parameter counts by group (all zero but the total's source for ParamsOnly, see parameter_count).
ParameterGroups parameter_groups(const ModelSpec& spec);

/// Exact parameter count, as `sum(p.numel() for p in model.parameters())` of the Hugging Face class:
/// GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (tied weights counted once);
/// BertModel (with pooler) or, with masked_lm_head, BertForMaskedLM. ParamsOnly: explicit_param_count.
int64_t parameter_count(const ModelSpec& spec);

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
