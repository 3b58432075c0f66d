#include "gpuops/estimator/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"

namespace gpuops::estimator {
namespace {

int64_t norm_params(const ModelSpec& s) {
  // LayerNorm has weight and bias; RMSNorm only a weight.
  return s.norm == NormKind::LayerNorm ? 2 * s.hidden_size : s.hidden_size;
}

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
  const int64_t q_width = s.num_heads * effective_head_dim(s);
  const int64_t kv_width = s.num_kv_heads * effective_head_dim(s);
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
  const int64_t h = s.hidden_size;
  g.num_layers = s.num_layers;
  g.embeddings = s.vocab_size * h;
  if (s.learned_positions) g.embeddings += s.max_positions * h;
  g.embeddings += s.type_vocab_size * h;
  if (s.family == ModelFamily::Encoder) g.embeddings += 2 * h;  // BERT's embedding LayerNorm
  for (const char* p : {"q", "k", "v", "o"}) g.attention_per_layer += projection_shape(s, p).parameters();
  for (const auto& p : projection_names(s))
    if (p == "gate" || p == "up" || p == "down") g.mlp_per_layer += projection_shape(s, p).parameters();
  g.norms_per_layer = 2 * norm_params(s);
  if (s.family == ModelFamily::Decoder) {
    g.final_norm = norm_params(s);
    g.head = s.tied_embeddings ? 0 : s.vocab_size * h;  // lm_head has no bias in GPT-2/Llama/Mistral
  } else if (s.masked_lm_head) {
    // cls.predictions: transform dense (h x h + bias), LayerNorm, decoder tied to the embeddings + bias V.
    g.head = h * h + h + 2 * h + s.vocab_size;
  } else {
    g.head = h * h + h;  // BertModel's pooler
  }
  return g;
}

int64_t parameter_tensor_count(const ModelSpec& s) {
  if (s.family == ModelFamily::ParamsOnly) return 0;
  const int64_t per_norm = s.norm == NormKind::LayerNorm ? 2 : 1;
  int64_t embeddings = 1 + (s.learned_positions ? 1 : 0) + (s.type_vocab_size > 0 ? 1 : 0);
  if (s.family == ModelFamily::Encoder) embeddings += 2;  // embedding LayerNorm
  const int64_t qkv = s.fused_qkv ? 1 : 3, mlp = s.mlp == MlpKind::SwiGlu ? 3 : 2;
  int64_t per_layer = qkv + 1 + mlp + 2 * per_norm;
  if (s.linear_bias) per_layer += qkv + 1 + mlp;
  else if (s.qkv_bias) per_layer += qkv;
  int64_t rest = 0;
  if (s.family == ModelFamily::Decoder) rest = per_norm + (s.tied_embeddings ? 0 : 1);
  else rest = s.masked_lm_head ? 5 : 2;  // MLM: dense w+b, LayerNorm w+b, decoder bias; else pooler w+b
  return embeddings + s.num_layers * per_layer + rest;
}

int64_t largest_parameter_tensor(const ModelSpec& s) {
  if (s.family == ModelFamily::ParamsOnly) return 0;
  int64_t largest = s.vocab_size * s.hidden_size;
  if (s.learned_positions) largest = std::max(largest, s.max_positions * s.hidden_size);
  for (const auto& p : projection_names(s)) {
    const LinearShape l = projection_shape(s, p);
    largest = std::max(largest, l.in_features * l.out_features);
  }
  if (s.fused_qkv) {
    int64_t qkv = 0;
    for (const char* p : {"q", "k", "v"}) qkv += projection_shape(s, p).in_features * projection_shape(s, p).out_features;
    largest = std::max(largest, qkv);
  }
  return largest;
}

int64_t parameter_count(const ModelSpec& spec) {
  if (spec.family == ModelFamily::ParamsOnly) return spec.explicit_param_count;
  return parameter_groups(spec).total();
}

void validate(const ModelSpec& s) {
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
}

int64_t parse_param_count(std::string_view text) {
  const std::string t(text);
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  double scale = 1;
  bool ok = used > 0;
  if (ok && used < t.size()) {
    // One suffix letter, case-insensitive: k, M, B (or G), T.
    const std::string rest = t.substr(used);
    if (rest.size() != 1) {
      ok = false;
    } else {
      switch (std::tolower(static_cast<unsigned char>(rest[0]))) {
        case 'k': scale = 1e3; break;
        case 'm': scale = 1e6; break;
        case 'b': case 'g': scale = 1e9; break;
        case 't': scale = 1e12; break;
        default: ok = false;
      }
    }
  }
  const double count = value * scale;
  ok = ok && std::isfinite(count) && count >= 1 && count < 9.0e18;
  GPUOPS_CHECK_ARG(ok, "params '{}' is not a parameter count; accepted: a number >= 1 with an optional "
                   "suffix k, M, B or T (e.g. 7B, 125M, 6738415616)", text);
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
