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

using C = CheckedInt;

int64_t norm_params(const ModelSpec& s) {
  // LayerNorm has weight and bias; RMSNorm only a weight.
  return s.norm == NormKind::LayerNorm ? (2 * C(s.hidden_size)).get() : s.hidden_size;
}

int64_t elements(const LinearShape& l) { return (C(l.in_features) * l.out_features).get(); }

}  // namespace

int64_t effective_head_dim(const ModelSpec& spec) {
  if (spec.head_dim > 0) return spec.head_dim;
  return spec.num_heads > 0 ? spec.hidden_size / spec.num_heads : 0;
}

std::vector<std::string> projection_names(const ModelSpec& spec) {
  if (spec.mlp == MlpKind::SwiGlu) return {"q", "k", "v", "o", "gate", "up", "down"};
  return {"q", "k", "v", "o", "up", "down"};
}

LinearShape projection_shape(const ModelSpec& s, std::string_view name) {
  const int64_t h = s.hidden_size;
  const int64_t q_width = (C(s.num_heads) * effective_head_dim(s)).get();
  const int64_t kv_width = (C(s.num_kv_heads) * effective_head_dim(s)).get();
  const bool qkv_bias = s.linear_bias || s.qkv_bias;
  // GPT-2's fused c_attn is counted as three h x h projections: same parameters, and LoRA on "q"/"v"
  // then means the q and v thirds.
  if (name == "q") return {h, q_width, qkv_bias};
  if (name == "k") return {h, kv_width, qkv_bias};
  if (name == "v") return {h, kv_width, qkv_bias};
  if (name == "o") return {q_width, h, s.linear_bias};
  if (name == "up") return {h, s.intermediate_size, s.linear_bias};
  if (name == "down") return {s.intermediate_size, h, s.linear_bias};
  if (name == "gate" && s.mlp == MlpKind::SwiGlu) return {h, s.intermediate_size, s.linear_bias};
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
  C attention = 0, mlp = 0;
  for (const char* p : {"q", "k", "v", "o"}) attention += projection_shape(s, p).parameters();
  for (const auto& p : projection_names(s))
    if (p == "gate" || p == "up" || p == "down") mlp += projection_shape(s, p).parameters();
  g.attention_per_layer = attention.get();
  g.mlp_per_layer = mlp.get();
  g.norms_per_layer = (2 * C(norm_params(s))).get();
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
  const int64_t qkv = s.fused_qkv ? 1 : 3, mlp = s.mlp == MlpKind::SwiGlu ? 3 : 2;
  const int64_t per_layer = qkv + 1 + mlp + 2 * per_norm + (s.linear_bias ? qkv + 1 + mlp : s.qkv_bias ? qkv : 0);
  int64_t rest = 0;
  if (s.family == ModelFamily::Decoder) rest = per_norm + (s.tied_embeddings ? 0 : 1);
  else rest = s.masked_lm_head ? 5 : 2;  // MLM: dense w+b, LayerNorm w+b, decoder bias; else pooler w+b
  return (C(s.num_layers) * per_layer + embeddings + rest).get();
}

int64_t largest_parameter_tensor(const ModelSpec& s) {
  if (s.family == ModelFamily::ParamsOnly) return 0;
  int64_t largest = (C(s.vocab_size) * s.hidden_size).get();
  if (s.learned_positions) largest = std::max(largest, (C(s.max_positions) * s.hidden_size).get());
  for (const auto& p : projection_names(s)) largest = std::max(largest, elements(projection_shape(s, p)));
  if (s.fused_qkv) {
    C qkv = 0;
    for (const char* p : {"q", "k", "v"}) qkv += elements(projection_shape(s, p));
    largest = std::max(largest, qkv.get());
  }
  return largest;
}

int64_t parameter_count(const ModelSpec& spec) {
  if (spec.family == ModelFamily::ParamsOnly) return spec.explicit_param_count;
  return parameter_groups(spec).total();
}

void validate(const ModelSpec& s) {
  GPUOPS_CHECK_ARG(s.family == ModelFamily::Decoder || s.family == ModelFamily::Encoder ||
                       s.family == ModelFamily::ParamsOnly,
                   "model '{}': family {} is not a ModelFamily; accepted: Decoder, Encoder, ParamsOnly", s.name,
                   static_cast<int>(s.family));
  if (s.family == ModelFamily::ParamsOnly) {
    GPUOPS_CHECK_ARG(s.explicit_param_count > 0, "model parameter count must be > 0, got {}",
                     s.explicit_param_count);
    return;
  }
  auto positive = [&](const char* field, int64_t v) {
    GPUOPS_CHECK_ARG(v > 0, "model '{}': {} must be > 0, got {}", s.name, field, v);
  };
  positive("vocab_size", s.vocab_size);
  positive("hidden_size", s.hidden_size);
  positive("num_layers", s.num_layers);
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
