#include "gpuops/estimator/hf_config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuops/errors.h"

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

ModelSpec from_llama_like(const Config& c, bool qkv_bias) {
  ModelSpec s;
  s.family = ModelFamily::Decoder;
  s.vocab_size = c.positive("vocab_size");
  s.hidden_size = c.positive("hidden_size");
  s.num_layers = c.positive("num_hidden_layers");
  s.num_heads = c.positive("num_attention_heads");
  s.num_kv_heads = c.positive_or("num_key_value_heads", s.num_heads);
  s.head_dim = c.non_negative_or("head_dim", 0);
  s.intermediate_size = c.positive("intermediate_size");
  s.max_positions = c.positive_or("max_position_embeddings", 4096);
  s.mlp = MlpKind::SwiGlu;
  s.norm = NormKind::RmsNorm;
  s.tied_embeddings = c.boolean_or("tie_word_embeddings", false);
  s.learned_positions = false;
  // Llama's attention_bias also puts a bias on o (hidden_size values per layer, not counted here).
  s.qkv_bias = qkv_bias || c.boolean_or("attention_bias", false);
  s.attention_dropout = c.number_or("attention_dropout", 0.0) > 0;
  s.softmax_upcast = true;
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
                   "config '{}': required key 'model_type' is missing or not a string; accepted: gpt2, "
                   "llama, mistral, qwen2, bert", name);
  const Config c(j, name);
  const std::string type = c.model_type();
  ModelSpec s;
  if (type == "gpt2") {
    s = from_gpt2(c);
  } else if (type == "llama" || type == "mistral") {
    s = from_llama_like(c, false);
  } else if (type == "qwen2") {
    s = from_llama_like(c, true);  // Qwen2 has biases on q, k, v only
  } else if (type == "bert") {
    s = from_bert(c);
  } else {
    throw ArgumentError(fmt::format("config '{}': model_type '{}' is not supported; accepted: gpt2, llama, "
                                    "mistral, qwen2, bert", name, type));
  }
  s.name = std::move(name);
  validate(s);
  return s;
}

ModelSpec model_from_hf_config_file(const std::string& path) {
  // Opened without blocking and checked before reading: a FIFO would block the open (or the read)
  // forever, a directory reads as nothing, a device as endless bytes.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  GPUOPS_CHECK_ARG(fd >= 0, "config '{}' cannot be read ({}); give the path of a Hugging Face config.json", path,
                   std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  GPUOPS_CHECK_ARG(::fstat(fd, &st) == 0, "config '{}' cannot be read ({}); give the path of a Hugging Face "
                   "config.json", path, std::strerror(errno));
  GPUOPS_CHECK_ARG(!S_ISDIR(st.st_mode), "config '{}' is a directory; give the path of its config.json file", path);
  GPUOPS_CHECK_ARG(S_ISREG(st.st_mode), "config '{}' is not a regular file (a FIFO, socket or device); give the "
                   "path of a Hugging Face config.json", path);
  GPUOPS_CHECK_ARG(st.st_size <= kMaxConfigBytes, "config '{}' is {} bytes; accepted: a config.json of at most {} "
                   "bytes", path, static_cast<int64_t>(st.st_size), kMaxConfigBytes);
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    GPUOPS_CHECK_ARG(n >= 0, "config '{}' cannot be read ({}); give the path of a Hugging Face config.json", path,
                     std::strerror(errno));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    GPUOPS_CHECK_ARG(static_cast<int64_t>(text.size()) <= kMaxConfigBytes,
                     "config '{}' is larger than {} bytes; accepted: a config.json of at most that", path,
                     kMaxConfigBytes);
  }
  return model_from_hf_config(text, path);
}

}  // namespace gpuops::estimator
