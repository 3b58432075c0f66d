#include "gpuops/estimator/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"

namespace gpuops::estimator {

namespace {
constexpr int64_t kMaxLayers = 2048;
constexpr int64_t kMaxParameterTensors = int64_t{1} << 18;
}  // namespace
namespace {

using C = CheckedInt;

int64_t norm_params(const ModelSpec& s) {
  // LayerNorm has weight and bias; RMSNorm only a weight.
  return s.norm == NormKind::LayerNorm ? (2 * C(s.hidden_size)).get() : s.hidden_size;
}

int64_t elements(const LinearShape& l) { return (C(l.in_features) * l.out_features).get(); }

bool gated_mlp(const ModelSpec& s) { return s.mlp == MlpKind::SwiGlu; }

std::vector<std::string> attention_names(const ModelSpec& s) {
  if (!is_mla(s)) return {"q", "k", "v", "o"};
  if (s.q_lora_rank > 0) return {"q_a", "q_b", "kv_a", "kv_b", "o"};
  return {"q", "kv_a", "kv_b", "o"};
}

std::vector<std::string> mlp_names(const ModelSpec& s) {
  if (gated_mlp(s)) return {"gate", "up", "down"};
  return {"up", "down"};
}

// Shape of a block linear by name, without checking that the model has it.
LinearShape shape_of(const ModelSpec& s, std::string_view name) {
  const int64_t h = s.hidden_size;
  if (is_mla(s)) {  // DeepSeek-V2/V3 (transformers' DeepseekV2Attention); attention_bias is kept in o_bias
    const C qk = C(s.num_heads) * (C(s.qk_nope_head_dim) + s.qk_rope_head_dim);
    if (name == "q") return {h, qk.get(), false};
    if (name == "q_a") return {h, s.q_lora_rank, s.o_bias};
    if (name == "q_b") return {s.q_lora_rank, qk.get(), false};
    if (name == "kv_a") return {h, (C(s.kv_lora_rank) + s.qk_rope_head_dim).get(), s.o_bias};
    if (name == "kv_b")
      return {s.kv_lora_rank, (C(s.num_heads) * (C(s.qk_nope_head_dim) + s.v_head_dim)).get(), false};
    if (name == "o") return {(C(s.num_heads) * s.v_head_dim).get(), h, s.o_bias};
  }
  const int64_t q_width = (C(s.num_heads) * effective_head_dim(s)).get();
  const int64_t kv_width = (C(s.num_kv_heads) * effective_head_dim(s)).get();
  const bool qkv_bias = s.linear_bias || s.qkv_bias;
  const bool mlp_bias = s.linear_bias || s.mlp_bias;
  // GPT-2's fused c_attn (and Phi-3's qkv_proj) is counted as three projections: same parameters, and
  // LoRA on "q"/"v" then means the q and v slices.
  if (name == "q") return {h, q_width, qkv_bias};
  if (name == "k") return {h, kv_width, qkv_bias};
  if (name == "v") return {h, kv_width, qkv_bias};
  if (name == "o") return {q_width, h, s.linear_bias || s.o_bias};
  if (name == "up" || name == "gate") return {h, s.intermediate_size, mlp_bias};
  if (name == "down") return {s.intermediate_size, h, mlp_bias};
  // Mixture of experts (Mixtral's w1/w3/w2, Qwen2-MoE's and DeepSeek's gate/up/down_proj per expert).
  if (name == "expert_gate" || name == "expert_up") return {h, s.moe_intermediate_size, s.mlp_bias};
  if (name == "expert_down") return {s.moe_intermediate_size, h, s.mlp_bias};
  if (name == "router") return {h, s.num_experts, false};
  if (name == "shared_gate" || name == "shared_up") return {h, s.shared_expert_intermediate_size, s.mlp_bias};
  if (name == "shared_down") return {s.shared_expert_intermediate_size, h, s.mlp_bias};
  if (name == "shared_expert_gate") return {h, 1, false};
  return {};
}

// Parameters of one MoE layer's MLP: router, every routed expert, shared experts and their gate.
C moe_mlp_parameters(const ModelSpec& s) {
  C experts = 0;
  for (const char* p : {"expert_gate", "expert_up", "expert_down"}) experts += shape_of(s, p).parameters();
  C n = C(s.num_experts) * experts + shape_of(s, "router").parameters();
  if (s.shared_expert_intermediate_size > 0)
    for (const char* p : {"shared_gate", "shared_up", "shared_down"}) n += shape_of(s, p).parameters();
  if (s.shared_expert_gate) n += shape_of(s, "shared_expert_gate").parameters();
  return n;
}

// MLA's norms inside the attention: q_a_layernorm (with a q LoRA rank) and kv_a_layernorm, RMSNorm weights.
int64_t mla_norm_params(const ModelSpec& s) { return is_mla(s) ? (C(s.q_lora_rank) + s.kv_lora_rank).get() : 0; }

// The fields of the model families (Gemma-2, Phi-3, MoE, MLA), each named with its value.
void validate_family_fields(const ModelSpec& s) {
  auto at_least = [&](const char* field, int64_t v, int64_t min) {
    GPUOPS_CHECK_ARG(v >= min, "model '{}': {} must be >= {}, got {}", s.name, field, min, v);
  };
  at_least("norms_per_layer", s.norms_per_layer, 1);
  at_least("sliding_window", s.sliding_window, 0);
  for (const auto& [field, v] : {std::pair{"attn_logit_softcapping", s.attn_logit_softcapping},
                                 std::pair{"final_logit_softcapping", s.final_logit_softcapping}})
    GPUOPS_CHECK_ARG(std::isfinite(v) && v >= 0, "model '{}': {} must be a finite number >= 0 (0: none), got {}",
                     s.name, field, v);
  at_least("num_experts", s.num_experts, 0);
  at_least("shared_expert_intermediate_size", s.shared_expert_intermediate_size, 0);
  if (s.num_experts > 0) {
    GPUOPS_CHECK_ARG(s.family == ModelFamily::Decoder, "model '{}': experts apply to decoder models only", s.name);
    GPUOPS_CHECK_ARG(s.experts_per_token >= 1 && s.experts_per_token <= s.num_experts,
                     "model '{}': num_experts_per_tok must be from 1 to num_experts ({}), got {}", s.name,
                     s.num_experts, s.experts_per_token);
    at_least("moe_intermediate_size", s.moe_intermediate_size, 1);
    GPUOPS_CHECK_ARG(static_cast<int64_t>(s.moe_layers.size()) == s.num_layers,
                     "model '{}': moe_layers has {} entries; accepted: one per layer ({})", s.name,
                     s.moe_layers.size(), s.num_layers);
  } else {
    GPUOPS_CHECK_ARG(s.experts_per_token == 0 && s.moe_layers.empty() && s.shared_expert_intermediate_size == 0 &&
                         !s.shared_expert_gate,
                     "model '{}': experts_per_token, moe_layers and shared experts need num_experts > 0", s.name);
  }
  for (const auto& [field, v] : {std::pair{"q_lora_rank", s.q_lora_rank}, std::pair{"kv_lora_rank", s.kv_lora_rank},
                                 std::pair{"qk_nope_head_dim", s.qk_nope_head_dim},
                                 std::pair{"qk_rope_head_dim", s.qk_rope_head_dim},
                                 std::pair{"v_head_dim", s.v_head_dim}})
    at_least(field, v, 0);
  if (is_mla(s)) {
    at_least("qk_rope_head_dim", s.qk_rope_head_dim, 1);
    at_least("v_head_dim", s.v_head_dim, 1);
    GPUOPS_CHECK_ARG(s.family == ModelFamily::Decoder, "model '{}': MLA attention applies to decoders only", s.name);
  }
  GPUOPS_CHECK_ARG(!s.fused_gate_up || s.mlp == MlpKind::SwiGlu,
                   "model '{}': fused_gate_up needs a gated (SwiGlu) MLP", s.name);
}

}  // namespace

bool is_mla(const ModelSpec& spec) { return spec.kv_lora_rank > 0; }

int64_t moe_layer_count(const ModelSpec& spec) {
  if (spec.num_experts == 0) return 0;
  return static_cast<int64_t>(std::count(spec.moe_layers.begin(), spec.moe_layers.end(), true));
}

bool is_moe_layer(const ModelSpec& spec, int64_t layer) {
  return spec.num_experts > 0 && layer >= 0 && layer < static_cast<int64_t>(spec.moe_layers.size()) &&
         spec.moe_layers[static_cast<size_t>(layer)];
}

std::vector<LinearGroup> block_linears(const ModelSpec& s) {
  std::vector<LinearGroup> groups;
  if (s.family == ModelFamily::ParamsOnly) return groups;
  const int64_t L = s.num_layers, moe = moe_layer_count(s);
  auto add = [&](const std::string& name, int64_t count) {
    if (count > 0) groups.push_back({name, shape_of(s, name), count});
  };
  for (const auto& p : attention_names(s)) add(p, L);
  for (const auto& p : mlp_names(s)) add(p, L - moe);
  if (moe > 0) {
    const int64_t experts = (C(moe) * s.num_experts).get();
    for (const char* p : {"expert_gate", "expert_up", "expert_down"}) add(p, experts);
    add("router", moe);
    if (s.shared_expert_intermediate_size > 0)
      for (const char* p : {"shared_gate", "shared_up", "shared_down"}) add(p, moe);
    if (s.shared_expert_gate) add("shared_expert_gate", moe);
  }
  return groups;
}

int64_t effective_head_dim(const ModelSpec& spec) {
  if (spec.head_dim > 0) return spec.head_dim;
  return spec.num_heads > 0 ? spec.hidden_size / spec.num_heads : 0;
}

std::vector<std::string> projection_names(const ModelSpec& spec) {
  std::vector<std::string> names = attention_names(spec);
  if (moe_layer_count(spec) == 0)  // MoE models: LoRA targets the attention projections only
    for (auto& p : mlp_names(spec)) names.push_back(std::move(p));
  return names;
}

LinearShape projection_shape(const ModelSpec& s, std::string_view name) {
  const auto names = projection_names(s);
  if (std::find(names.begin(), names.end(), name) != names.end()) return shape_of(s, name);
  throw ArgumentError(fmt::format("projection '{}' is not in model '{}'; accepted: {}", name, s.name,
                                  fmt::join(projection_names(s), ",")));
}

ParameterGroups parameter_groups(const ModelSpec& s) {
  ParameterGroups g;
  if (s.family == ModelFamily::ParamsOnly) return g;
  const C h = s.hidden_size;
  g.num_layers = s.num_layers;
  C embeddings = C(s.vocab_size) * h + C(s.type_vocab_size) * h;
  if (s.learned_positions) embeddings += C(s.max_positions) * h;
  if (s.family == ModelFamily::Encoder) embeddings += 2 * h;  // BERT's embedding LayerNorm
  g.embeddings = embeddings.get();
  C attention = mla_norm_params(s), mlp = 0;
  for (const auto& p : attention_names(s)) attention += shape_of(s, p).parameters();
  for (const auto& p : mlp_names(s)) mlp += shape_of(s, p).parameters();
  g.attention_per_layer = attention.get();
  g.mlp_per_layer = mlp.get();
  g.norms_per_layer = (C(s.norms_per_layer) * norm_params(s)).get();
  g.moe_layers = moe_layer_count(s);
  if (g.moe_layers > 0) g.moe_mlp_per_layer = moe_mlp_parameters(s).get();
  if (s.family == ModelFamily::Decoder) {
    g.final_norm = norm_params(s);
    g.head = s.tied_embeddings ? 0 : (C(s.vocab_size) * h).get();  // lm_head has no bias in GPT-2/Llama/Mistral
  } else if (s.masked_lm_head) {
    // cls.predictions: transform dense (h x h + bias), LayerNorm, decoder tied to the embeddings + bias V.
    g.head = (h * h + h + 2 * h + s.vocab_size).get();
  } else {
    g.head = (h * h + h).get();  // BertModel's pooler
  }
  return g;
}

int64_t parameter_tensor_count(const ModelSpec& s) {
  if (s.family == ModelFamily::ParamsOnly) return 0;
  const int64_t per_norm = s.norm == NormKind::LayerNorm ? 2 : 1;
  int64_t embeddings = 1 + (s.learned_positions ? 1 : 0) + (s.type_vocab_size > 0 ? 1 : 0);
  if (s.family == ModelFamily::Encoder) embeddings += 2;  // embedding LayerNorm
  // Every block linear is a weight and maybe a bias; fused projections are one tensor (GPT-2's c_attn,
  // Phi-3's qkv_proj and gate_up_proj).
  C linears = 0;
  for (const auto& g : block_linears(s)) linears += C(g.count) * (g.shape.bias ? 2 : 1);
  const int64_t L = s.num_layers, dense = L - moe_layer_count(s);
  if (s.fused_qkv) linears = linears - C(L) * 2 * (shape_of(s, "q").bias ? 2 : 1);
  if (s.fused_gate_up) linears = linears - C(dense) * (shape_of(s, "up").bias ? 2 : 1);
  const int64_t mla_norms = is_mla(s) ? (s.q_lora_rank > 0 ? 2 : 1) : 0;
  const C per_layer_norms = C(s.norms_per_layer) * per_norm + mla_norms;
  int64_t rest = 0;
  if (s.family == ModelFamily::Decoder) rest = per_norm + (s.tied_embeddings ? 0 : 1);
  else rest = s.masked_lm_head ? 5 : 2;  // MLM: dense w+b, LayerNorm w+b, decoder bias; else pooler w+b
  return (linears + C(L) * per_layer_norms + embeddings + rest).get();
}

int64_t largest_parameter_tensor(const ModelSpec& s) {
  if (s.family == ModelFamily::ParamsOnly) return 0;
  int64_t largest = (C(s.vocab_size) * s.hidden_size).get();
  if (s.learned_positions) largest = std::max(largest, (C(s.max_positions) * s.hidden_size).get());
  for (const auto& g : block_linears(s)) largest = std::max(largest, elements(g.shape));
  if (s.fused_gate_up && moe_layer_count(s) < s.num_layers)
    largest = std::max(largest, (2 * C(elements(shape_of(s, "up")))).get());
  if (s.fused_qkv) {
    C qkv = 0;
    for (const char* p : {"q", "k", "v"}) qkv += elements(shape_of(s, p));
    largest = std::max(largest, qkv.get());
  }
  return largest;
}

int64_t parameter_count(const ModelSpec& spec) {
  if (spec.family == ModelFamily::ParamsOnly) return spec.explicit_param_count;
  return parameter_groups(spec).total();
}

double training_flops_per_token(const ModelSpec& spec, int64_t seq_len) {
  GPUOPS_CHECK_ARG(spec.family != ModelFamily::ParamsOnly && spec.num_experts == 0,
                   "flops per token of model '{}' is not counted: {}; accepted: a dense model with an architecture, "
                   "or the count given yourself", spec.name,
                   spec.num_experts > 0 ? "its tokens use experts_per_token of its experts" : "no architecture");
  GPUOPS_CHECK_ARG(seq_len >= 1, "seq-len {} is not accepted; accepted: >= 1", seq_len);
  const double table = static_cast<double>(spec.vocab_size) * static_cast<double>(spec.hidden_size);
  const double params = static_cast<double>(parameter_count(spec)) - (spec.tied_embeddings ? 0.0 : table);
  const double attention = 12.0 * static_cast<double>(spec.num_layers) * static_cast<double>(spec.num_heads) *
                           static_cast<double>(effective_head_dim(spec)) * static_cast<double>(seq_len);
  return 6.0 * params + attention;
}

void validate(const ModelSpec& s) {
  GPUOPS_CHECK_ARG(s.family == ModelFamily::Decoder || s.family == ModelFamily::Encoder ||
                       s.family == ModelFamily::ParamsOnly,
                   "model '{}': family {} is not a ModelFamily; accepted: Decoder, Encoder, ParamsOnly", s.name,
                   static_cast<int>(s.family));
  if (s.family == ModelFamily::ParamsOnly) {
    GPUOPS_CHECK_ARG(s.explicit_param_count > 0, "model parameter count must be > 0, got {}",
                     s.explicit_param_count);
    GPUOPS_CHECK_ARG(s.fixed_bytes >= 0, "model fixed bytes (frozen tensors and buffers) must be >= 0, got {}",
                     s.fixed_bytes);
    return;
  }
  auto positive = [&](const char* field, int64_t v) {
    GPUOPS_CHECK_ARG(v > 0, "model '{}': {} must be > 0, got {}", s.name, field, v);
  };
  positive("vocab_size", s.vocab_size);
  positive("hidden_size", s.hidden_size);
  positive("num_layers", s.num_layers);
  GPUOPS_CHECK_ARG(s.num_layers <= kMaxLayers, "model '{}': num_layers {} is not accepted; accepted: 1 to {} (the "
                   "deepest models have about 200; an estimate replays every layer)", s.name, s.num_layers, kMaxLayers);
  positive("num_heads", s.num_heads);
  positive("num_kv_heads", s.num_kv_heads);
  positive("intermediate_size", s.intermediate_size);
  positive("max_positions", s.max_positions);
  GPUOPS_CHECK_ARG(s.head_dim >= 0, "model '{}': head_dim must be >= 0 (0: hidden_size/num_heads), got {}",
                   s.name, s.head_dim);
  GPUOPS_CHECK_ARG(s.head_dim > 0 || s.hidden_size % s.num_heads == 0,
                   "model '{}': hidden_size {} is not divisible by num_heads {}; give head_dim", s.name,
                   s.hidden_size, s.num_heads);
  GPUOPS_CHECK_ARG(s.num_heads % s.num_kv_heads == 0,
                   "model '{}': num_kv_heads {} must divide num_heads {}", s.name, s.num_kv_heads, s.num_heads);
  GPUOPS_CHECK_ARG(s.type_vocab_size >= 0, "model '{}': type_vocab_size must be >= 0, got {}", s.name,
                   s.type_vocab_size);
  GPUOPS_CHECK_ARG(!s.masked_lm_head || s.family == ModelFamily::Encoder,
                   "model '{}': masked_lm_head applies to encoder models only", s.name);
  GPUOPS_CHECK_ARG(s.mlp == MlpKind::Gelu || s.mlp == MlpKind::SwiGlu,
                   "model '{}': mlp {} is not an MlpKind; accepted: Gelu, SwiGlu", s.name, static_cast<int>(s.mlp));
  GPUOPS_CHECK_ARG(s.norm == NormKind::LayerNorm || s.norm == NormKind::RmsNorm,
                   "model '{}': norm {} is not a NormKind; accepted: LayerNorm, RmsNorm", s.name,
                   static_cast<int>(s.norm));
  validate_family_fields(s);
  // Sizes that count more than 2^63 - 1 parameters (or tensors) cannot be estimated.
  try {
    parameter_count(s);
    parameter_tensor_count(s);
    largest_parameter_tensor(s);
  } catch (const SizeOverflow&) {
    throw ArgumentError(fmt::format(
        "model '{}': its parameter count overflows 64 bits (vocab_size {}, hidden_size {}, num_layers {}, "
        "num_heads {}, head_dim {}, intermediate_size {}, max_positions {}, type_vocab_size {}); accepted: sizes "
        "whose parameter count is below 2^63", s.name, s.vocab_size, s.hidden_size, s.num_layers, s.num_heads,
        effective_head_dim(s), s.intermediate_size, s.max_positions, s.type_vocab_size));
  }
  // The replay of a step handles every parameter tensor: bounded, so that any accepted model is answered in
  // bounded time and memory.
  const int64_t tensors = parameter_tensor_count(s);
  GPUOPS_CHECK_ARG(tensors <= kMaxParameterTensors, "model '{}': {} parameter tensors (num_layers {}, num_experts {}); "
                   "accepted: at most {} (DeepSeek-V3 has about 47,000)", s.name, tensors, s.num_layers, s.num_experts,
                   kMaxParameterTensors);
}

namespace {

// Length of the longest prefix of `t` from `i` that is decimal digits.
size_t digits_from(std::string_view t, size_t i) {
  size_t n = 0;
  while (i + n < t.size() && std::isdigit(static_cast<unsigned char>(t[i + n]))) ++n;
  return n;
}

// True when `t` is digits [. digits] [e [+-] digits]: plain decimal, so that std::stod's extras (hex,
// inf, nan, leading spaces and signs) are refused instead of read ("0x10" is not 16 parameters).
bool is_decimal_number(std::string_view t) {
  size_t i = digits_from(t, 0);
  size_t mantissa = i;
  if (i < t.size() && t[i] == '.') {
    const size_t fraction = digits_from(t, i + 1);
    mantissa += fraction;
    i += 1 + fraction;
  }
  if (mantissa == 0) return false;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    const size_t exponent = digits_from(t, i);
    if (exponent == 0) return false;
    i += exponent;
  }
  return i == t.size();
}

}  // namespace

int64_t parse_param_count(std::string_view text) {
  std::string_view number = text;
  double scale = 1;
  if (!number.empty()) {  // one suffix letter, case-insensitive: k, M, B (or G), T
    switch (std::tolower(static_cast<unsigned char>(number.back()))) {
      case 'k': scale = 1e3; break;
      case 'm': scale = 1e6; break;
      case 'b': case 'g': scale = 1e9; break;
      case 't': scale = 1e12; break;
      default: scale = 0;
    }
    if (scale != 0) number.remove_suffix(1);
    else scale = 1;
  }
  const bool ok = is_decimal_number(number);
  const double count = ok ? std::strtod(std::string(number).c_str(), nullptr) * scale : 0;  // 1e999: inf
  // 2^63 is the first double past int64's range.
  GPUOPS_CHECK_ARG(ok && std::isfinite(count) && count >= 1 && count < 9223372036854775808.0,
                   "params '{}' is not a parameter count; accepted: a decimal number from 1 to 2^63 - 1 with an "
                   "optional suffix k, M, B or T (e.g. 7B, 125M, 6738415616)", text);
  return static_cast<int64_t>(std::llround(count));
}

ModelSpec params_only_model(int64_t count, std::string name) {
  ModelSpec s;
  s.family = ModelFamily::ParamsOnly;
  s.explicit_param_count = count;
  s.name = name.empty() ? fmt::format("{} parameters", count) : std::move(name);
  validate(s);
  return s;
}

std::string_view to_string(ModelFamily f) {
  switch (f) {
    case ModelFamily::Decoder: return "decoder";
    case ModelFamily::Encoder: return "encoder";
    case ModelFamily::ParamsOnly: return "params-only";
  }
  return "?";
}
std::string_view to_string(MlpKind m) { return m == MlpKind::Gelu ? "gelu" : "swiglu"; }
std::string_view to_string(NormKind n) { return n == NormKind::LayerNorm ? "layernorm" : "rmsnorm"; }

}  // namespace gpuops::estimator
