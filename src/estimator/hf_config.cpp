#include "gpuops/estimator/hf_config.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuops/errors.h"
#include "text_file.h"

namespace gpuops::estimator {
namespace {

using nlohmann::json;

// A config.json is a few kB; anything this large is not one (and would be read into memory whole).
constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;

// Typed access to config keys; every failure names the config and the key.
class Config {
 public:
  Config(const json& j, const std::string& name) : j_(j), name_(name) {}

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  int64_t positive(const char* key) const {
    GPUOPS_CHECK_ARG(has(key), "config '{}': required key '{}' is missing (model_type {})", name_, key,
                     model_type());
    return positive_value(key);
  }
  int64_t positive_or(const char* key, int64_t fallback) const {
    return has(key) ? positive_value(key) : fallback;
  }
  int64_t non_negative_or(const char* key, int64_t fallback) const {
    return has(key) ? integer_value(key, 0) : fallback;
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    GPUOPS_CHECK_ARG(v.is_boolean(), "config '{}': key '{}' must be true or false, got {}", name_, key,
                     v.dump());
    return v.get<bool>();
  }
  double number_or(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    GPUOPS_CHECK_ARG(v.is_number(), "config '{}': key '{}' must be a number, got {}", name_, key, v.dump());
    return v.get<double>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    GPUOPS_CHECK_ARG(v.is_string(), "config '{}': key '{}' must be a string, got {}", name_, key, v.dump());
    return v.get<std::string>();
  }
  // The first of `keys` the config has (aliases such as hidden_size / n_embd / d_model), or nullptr.
  const char* first_of(std::initializer_list<const char*> keys) const {
    for (const char* k : keys)
      if (has(k)) return k;
    return nullptr;
  }
  int64_t positive_any(std::initializer_list<const char*> keys) const {
    const char* key = first_of(keys);
    GPUOPS_CHECK_ARG(key != nullptr, "config '{}': required key '{}' is missing (model_type {}){}", name_,
                     *keys.begin(), model_type(), also_accepted(keys));
    return positive_value(key);
  }
  int64_t positive_any_or(std::initializer_list<const char*> keys, int64_t fallback) const {
    const char* key = first_of(keys);
    return key != nullptr ? positive_value(key) : fallback;
  }
  // A key that must be present but may be null (DeepSeek's q_lora_rank): null reads as 0.
  int64_t nullable_required(const char* key, const char* null_means) const {
    GPUOPS_CHECK_ARG(j_.contains(key), "config '{}': required key '{}' is missing (model_type {}); give null for {}",
                     name_, key, model_type(), null_means);
    return has(key) ? positive_value(key) : 0;
  }
  // A list of non-negative integers (Qwen2-MoE's mlp_only_layers); absent or null: empty.
  std::vector<int64_t> index_list(const char* key) const {
    std::vector<int64_t> out;
    if (!has(key)) return out;
    const json& v = j_.at(key);
    GPUOPS_CHECK_ARG(v.is_array(), "config '{}': key '{}' must be a list of layer indices, got {}", name_, key,
                     v.dump());
    for (const auto& item : v) {
      GPUOPS_CHECK_ARG(item.is_number_integer() && !(item.is_number_unsigned() && item.get<uint64_t>() > INT64_MAX) &&
                           item.get<int64_t>() >= 0,
                       "config '{}': key '{}' must be a list of layer indices (integers >= 0), got {}", name_, key,
                       item.dump());
      out.push_back(item.get<int64_t>());
    }
    return out;
  }
  std::string model_type() const {
    if (!j_.contains("model_type") || !j_.at("model_type").is_string()) return "?";
    return j_.at("model_type").get<std::string>();
  }
  bool architecture_is(const char* arch) const {
    if (!j_.contains("architectures") || !j_.at("architectures").is_array()) return false;
    for (const auto& a : j_.at("architectures"))
      if (a.is_string() && a.get<std::string>() == arch) return true;
    return false;
  }

 private:
  int64_t positive_value(const char* key) const { return integer_value(key, 1); }
  // An integer from `min` to 2^63 - 1 (an unsigned JSON integer above that would wrap in get<int64_t>).
  int64_t integer_value(const char* key, int64_t min) const {
    const json& v = j_.at(key);
    const bool in_range = v.is_number_integer() && (v.is_number_unsigned()
                                                         ? v.get<uint64_t>() <= uint64_t{INT64_MAX}
                                                         : v.get<int64_t>() >= min);
    GPUOPS_CHECK_ARG(in_range && v.get<int64_t>() >= min,
                     "config '{}': key '{}' must be an integer from {} to 9223372036854775807, got {}", name_, key,
                     min, v.dump());
    return v.get<int64_t>();
  }
  static std::string also_accepted(std::initializer_list<const char*> keys) {
    if (keys.size() < 2) return "";
    std::string out = "; also read as";
    for (auto k = keys.begin() + 1; k != keys.end(); ++k) out += std::string(k == keys.begin() + 1 ? " " : ", ") + *k;
    return out;
  }
  const json& j_;
  const std::string& name_;
};

ModelSpec from_gpt2(const Config& c) {
  ModelSpec s;
  s.family = ModelFamily::Decoder;
  s.vocab_size = c.positive("vocab_size");
  s.hidden_size = c.positive("n_embd");
  s.num_layers = c.positive("n_layer");
  s.num_heads = c.positive("n_head");
  s.num_kv_heads = s.num_heads;
  s.intermediate_size = c.positive_or("n_inner", 4 * s.hidden_size);  // null means 4 * n_embd
  s.max_positions = c.positive("n_positions");
  s.mlp = MlpKind::Gelu;
  s.norm = NormKind::LayerNorm;
  s.tied_embeddings = c.boolean_or("tie_word_embeddings", true);
  s.learned_positions = true;
  s.linear_bias = true;
  s.dropout = c.number_or("resid_pdrop", 0.1) > 0 || c.number_or("embd_pdrop", 0.1) > 0;
  s.attention_dropout = c.number_or("attn_pdrop", 0.1) > 0;
  s.fused_qkv = true;
  s.composite_gelu = c.string_or("activation_function", "gelu_new") == "gelu_new";
  s.causal_mask_buffers = true;
  return s;
}

// Largest layer count a MoE config may have (its per-layer MoE flags are kept in a list).
constexpr int64_t kMaxMoeLayers = int64_t{1} << 20;

bool one_of(const std::string& type, std::initializer_list<const char*> types) {
  for (const char* t : types)
    if (type == t) return true;
  return false;
}

// Reads the Mixture-of-Experts fields of Mixtral, Qwen2-MoE and DeepSeek-V2/V3 (and, for an unknown
// model_type, Mixtral-style num_local_experts / num_experts), and which layers are MoE.
void read_moe(const Config& c, const std::string& type, bool known, ModelSpec& s) {
  const int64_t L = s.num_layers;
  auto layers = [&](auto is_moe) {
    GPUOPS_CHECK_ARG(L <= kMaxMoeLayers, "config: num_hidden_layers {} is too large for a mixture-of-experts model; "
                     "accepted: 1 to {}", L, kMaxMoeLayers);
    s.moe_layers.assign(static_cast<size_t>(L), false);
    for (int64_t i = 0; i < L; ++i) s.moe_layers[static_cast<size_t>(i)] = is_moe(i);
  };
  if (type == "mixtral") {
    s.num_experts = c.positive("num_local_experts");
    s.experts_per_token = c.positive("num_experts_per_tok");
    s.moe_intermediate_size = s.intermediate_size;  // every layer's MLP is experts of intermediate_size
    s.norm_topk_prob = true;  // MixtralSparseMoeBlock always renormalises the top-k weights
    layers([](int64_t) { return true; });
  } else if (type == "qwen2_moe") {
    // transformers' Qwen2MoeDecoderLayer: sparse when not in mlp_only_layers and (i + 1) % decoder_sparse_step
    // == 0; every sparse block also has one shared expert with a sigmoid gate.
    s.num_experts = c.non_negative_or("num_experts", 60);
    if (s.num_experts == 0) return;
    s.experts_per_token = c.positive("num_experts_per_tok");
    s.moe_intermediate_size = c.positive("moe_intermediate_size");
    s.shared_expert_intermediate_size = c.non_negative_or("shared_expert_intermediate_size", 5632);
    s.shared_expert_gate = true;
    s.norm_topk_prob = c.boolean_or("norm_topk_prob", false);
    const int64_t step = c.positive_or("decoder_sparse_step", 1);
    const std::vector<int64_t> dense = c.index_list("mlp_only_layers");
    layers([&](int64_t i) { return (i + 1) % step == 0 && std::find(dense.begin(), dense.end(), i) == dense.end(); });
  } else if (type == "deepseek_v2" || type == "deepseek_v3") {
    // DeepSeek's modeling code: MoE when n_routed_experts is set, i >= first_k_dense_replace and
    // i % moe_layer_freq == 0; n_shared_experts shared experts form one MLP of that many times the width.
    s.num_experts = c.non_negative_or("n_routed_experts", 0);
    if (s.num_experts == 0) return;
    s.experts_per_token = c.positive("num_experts_per_tok");
    s.moe_intermediate_size = c.positive("moe_intermediate_size");
    s.shared_expert_intermediate_size =
        (CheckedInt(c.non_negative_or("n_shared_experts", 0)) * s.moe_intermediate_size).get();
    s.router_fp32 = true;
    s.norm_topk_prob = c.boolean_or("norm_topk_prob", false);
    const int64_t first = c.non_negative_or("first_k_dense_replace", 0), freq = c.positive_or("moe_layer_freq", 1);
    if (freq != 1)
      s.assumptions.push_back(fmt::format("moe_layer_freq {}: MoE on layers i >= first_k_dense_replace with i % {} "
                                          "== 0 (DeepSeek's code; transformers 4.57 ignores moe_layer_freq)", freq, freq));
    layers([&](int64_t i) { return i >= first && i % freq == 0; });
  } else if (!known && c.first_of({"num_local_experts", "num_experts"}) != nullptr) {
    s.num_experts = c.positive_any({"num_local_experts", "num_experts"});
    s.experts_per_token = c.positive("num_experts_per_tok");
    s.moe_intermediate_size = c.positive_or("moe_intermediate_size", s.intermediate_size);
    s.norm_topk_prob = c.boolean_or("norm_topk_prob", true);
    layers([](int64_t) { return true; });
    s.assumptions.push_back(fmt::format(
        "read as a Mixtral-style mixture of experts: every layer has {} SwiGLU experts of width {}, top-{} routing, "
        "a bias-free router and no shared experts", s.num_experts, s.moe_intermediate_size, s.experts_per_token));
  }
}

// DeepSeek-V2/V3 multi-head latent attention (transformers' DeepseekV2Attention).
void read_mla(const Config& c, ModelSpec& s) {
  s.q_lora_rank = c.nullable_required("q_lora_rank", "no query compression (q_proj)");
  s.kv_lora_rank = c.positive("kv_lora_rank");
  s.qk_nope_head_dim = c.non_negative_or("qk_nope_head_dim", 128);
  s.qk_rope_head_dim = c.positive("qk_rope_head_dim");
  s.v_head_dim = c.positive("v_head_dim");
  s.num_kv_heads = s.num_heads;
  s.head_dim = (CheckedInt(s.qk_nope_head_dim) + s.qk_rope_head_dim).get();  // activations: the q/k width
  s.assumptions.push_back(fmt::format(
      "MLA attention (kv_lora_rank {}): parameters exact; activations counted as multi-head attention with head "
      "width qk_nope_head_dim + qk_rope_head_dim = {} for q, k and v (v is {} wide: an upper bound), without the "
      "compressed kv_a / q_a intermediates", s.kv_lora_rank, s.head_dim, s.v_head_dim));
}

// Any decoder-only config, by the standard fields. Known model types set what their Hugging Face class
// hard-codes; an unknown one is read as a Llama-style decoder and says so in spec.assumptions.
ModelSpec from_decoder(const Config& c, const std::string& type) {
  const bool known = one_of(type, {"llama", "mistral", "qwen2", "gemma", "gemma2", "phi3", "mixtral", "qwen2_moe",
                                   "deepseek_v2", "deepseek_v3"});
  const bool gemma = type == "gemma" || type == "gemma2", deepseek = type == "deepseek_v2" || type == "deepseek_v3";
  ModelSpec s;
  s.family = ModelFamily::Decoder;
  s.model_type = type;
  s.vocab_size = c.positive("vocab_size");
  s.hidden_size = c.positive_any({"hidden_size", "n_embd", "d_model"});
  s.num_layers = c.positive_any({"num_hidden_layers", "n_layer", "num_layers"});
  s.num_heads = c.positive_any({"num_attention_heads", "n_head", "num_heads"});
  s.num_kv_heads = c.positive_any_or({"num_key_value_heads", "num_kv_heads"}, s.num_heads);
  s.head_dim = c.non_negative_or("head_dim", 0);
  s.intermediate_size = c.positive_any({"intermediate_size", "ffn_dim", "n_inner", "d_ff"});
  s.max_positions = c.positive_any_or({"max_position_embeddings", "n_positions", "max_seq_len"}, 4096);
  s.mlp = MlpKind::SwiGlu;  // gated: gate, up, down
  s.mlp_activation = gemma ? c.string_or("hidden_activation", c.string_or("hidden_act", "gelu_pytorch_tanh"))
                           : c.string_or("hidden_act", "silu");
  s.norm = NormKind::RmsNorm;
  s.tied_embeddings = c.boolean_or("tie_word_embeddings", gemma);  // GemmaConfig ties by default
  s.learned_positions = false;  // RoPE
  s.softmax_upcast = true;
  s.attention_dropout = c.number_or("attention_dropout", 0.0) > 0;
  // Biases: Qwen2 has them on q, k, v; attention_bias / mlp_bias where the class reads them.
  const bool attention_bias = one_of(type, {"llama", "gemma", "gemma2", "deepseek_v2", "deepseek_v3"}) || !known
                                  ? c.boolean_or("attention_bias", false) : false;
  s.qkv_bias = type == "qwen2" || (type == "qwen2_moe" && c.boolean_or("qkv_bias", true)) ||
               (attention_bias && !deepseek);
  s.o_bias = attention_bias;
  s.mlp_bias = one_of(type, {"llama", "deepseek_v2", "deepseek_v3"}) || !known ? c.boolean_or("mlp_bias", false)
                                                                                 : false;
  const bool window_on = !one_of(type, {"qwen2", "qwen2_moe"}) || c.boolean_or("use_sliding_window", false);
  if (window_on) s.sliding_window = c.non_negative_or("sliding_window", 0);
  if (type == "gemma2") {
    s.norms_per_layer = 4;  // input, post_attention, pre_feedforward, post_feedforward
    s.attn_logit_softcapping = c.number_or("attn_logit_softcapping", 0.0);
    s.final_logit_softcapping = c.number_or("final_logit_softcapping", 0.0);
  }
  s.scaled_embeddings = gemma;
  if (type == "phi3") {  // qkv_proj and gate_up_proj; dropout on both residual branches
    s.fused_qkv = true;
    s.fused_gate_up = true;
    s.dropout = c.number_or("resid_pdrop", 0.0) > 0;
  }
  if (deepseek) read_mla(c, s);
  read_moe(c, type, known, s);
  if (!known) {
    s.assumptions.insert(s.assumptions.begin(), fmt::format(
        "model_type '{}' is not known: read as a Llama-style decoder (RMSNorm, gated {} MLP, RoPE, {}{}{})", type,
        s.mlp_activation, s.tied_embeddings ? "tied embeddings" : "untied unless tie_word_embeddings",
        s.qkv_bias ? ", attention biases" : "", s.mlp_bias ? ", MLP biases" : ""));
  }
  if (s.attn_logit_softcapping > 0)
    s.assumptions.push_back(fmt::format(
        "attn_logit_softcapping {}: with --attention eager each layer saves one more s x s tensor (the tanh); "
        "transformers 4.57's sdpa path ignores the cap (eager is what Gemma-2 training should use) and "
        "flash-attn applies it inside the kernel", s.attn_logit_softcapping));
  if (s.final_logit_softcapping > 0)
    s.assumptions.push_back(fmt::format("final_logit_softcapping {}: the loss also saves the tanh of the logits "
                                        "(N x V in the compute dtype)", s.final_logit_softcapping));
  if (s.sliding_window > 0)
    s.assumptions.push_back(fmt::format(
        "sliding_window {}: memory counted as full causal attention (eager still materialises the s x s scores; "
        "flash and sdpa save no scores either way)", s.sliding_window));
  return s;
}

ModelSpec from_bert(const Config& c) {
  ModelSpec s;
  s.family = ModelFamily::Encoder;
  s.vocab_size = c.positive("vocab_size");
  s.hidden_size = c.positive("hidden_size");
  s.num_layers = c.positive("num_hidden_layers");
  s.num_heads = c.positive("num_attention_heads");
  s.num_kv_heads = s.num_heads;
  s.intermediate_size = c.positive("intermediate_size");
  s.max_positions = c.positive("max_position_embeddings");
  s.type_vocab_size = c.non_negative_or("type_vocab_size", 2);
  s.mlp = MlpKind::Gelu;
  s.norm = NormKind::LayerNorm;
  s.learned_positions = true;
  s.linear_bias = true;
  s.dropout = c.number_or("hidden_dropout_prob", 0.1) > 0;
  s.attention_dropout = c.number_or("attention_probs_dropout_prob", 0.1) > 0;
  s.masked_lm_head = c.architecture_is("BertForMaskedLM");
  return s;
}

// Encoder-decoder and encoder-only models are not decoders: refused rather than misread.
void refuse_non_decoder(const Config& c, const std::string& type, const std::string& name) {
  const bool encoder_decoder =
      c.boolean_or("is_encoder_decoder", false) ||
      one_of(type, {"t5", "mt5", "umt5", "longt5", "t5gemma", "bart", "mbart", "pegasus", "pegasus_x", "marian", "led",
                    "blenderbot", "blenderbot-small", "m2m_100", "nllb-moe", "fsmt", "prophetnet", "whisper",
                    "switch_transformers", "encoder-decoder"});
  const bool encoder = one_of(type, {"roberta", "xlm-roberta", "distilbert", "electra", "deberta", "deberta-v2",
                                     "albert", "camembert", "modernbert"});
  GPUOPS_CHECK_ARG(!encoder_decoder && !encoder,
                   "config '{}': model_type '{}' is an {} model; accepted: gpt2, bert, and decoder-only models "
                   "(llama, mistral, qwen2, gemma, gemma2, phi3, mixtral, qwen2_moe, deepseek_v2, deepseek_v3, or "
                   "another read by the standard fields)", name, type, encoder ? "encoder-only" : "encoder-decoder");
}

}  // namespace

ModelSpec model_from_hf_config(std::string_view json_text, std::string name) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw ArgumentError(fmt::format("config '{}' is not valid JSON: {}", name, e.what()));
  }
  GPUOPS_CHECK_ARG(j.is_object(), "config '{}' must be a JSON object, got {}", name, j.type_name());
  GPUOPS_CHECK_ARG(j.contains("model_type") && j.at("model_type").is_string(),
                   "config '{}': required key 'model_type' is missing or not a string; accepted: gpt2, bert, "
                   "or any decoder (llama, mistral, qwen2, gemma, gemma2, phi3, mixtral, qwen2_moe, deepseek_v2, "
                   "deepseek_v3, or another read by the standard fields)", name);
  const Config c(j, name);
  const std::string type = c.model_type();
  ModelSpec s;
  if (type == "gpt2") {
    s = from_gpt2(c);
  } else if (type == "bert") {
    s = from_bert(c);
  } else {
    refuse_non_decoder(c, type, name);
    s = from_decoder(c, type);  // any decoder-only config, by the standard fields
  }
  s.name = std::move(name);
  s.model_type = type;
  validate(s);
  return s;
}

ModelSpec model_from_hf_config_file(const std::string& path) {
  const std::string text = read_text_file(
      path, {"config", "config.json", "give the path of a Hugging Face config.json", kMaxConfigBytes});
  return model_from_hf_config(text, path);
}

}  // namespace gpuops::estimator
