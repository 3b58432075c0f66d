#include "gpuops/estimator/presets.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/printable.h"

#include "preset_configs.h"

namespace gpuops::estimator {
namespace {

// Values copied from the config.json of openai-community/gpt2*, meta-llama/Llama-2-*-hf,
// meta-llama/Meta-Llama-3-8B, mistralai/Mistral-7B-v0.1 and google-bert/bert-*-uncased.
ModelSpec gpt2(const char* name, int64_t h, int64_t layers, int64_t heads) {
  ModelSpec s;
  s.name = name;
  s.family = ModelFamily::Decoder;
  s.vocab_size = 50257;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = heads;
  s.intermediate_size = 4 * h;  // n_inner: null
  s.max_positions = 1024;
  s.mlp = MlpKind::Gelu;
  s.norm = NormKind::LayerNorm;
  s.tied_embeddings = true;
  s.learned_positions = true;
  s.linear_bias = true;
  s.dropout = true;  // resid/embd/attn_pdrop 0.1
  s.attention_dropout = true;
  s.fused_qkv = true;  // c_attn
  s.composite_gelu = true;  // gelu_new
  s.causal_mask_buffers = true;
  return s;
}

ModelSpec llama(const char* name, int64_t vocab, int64_t h, int64_t layers, int64_t heads, int64_t kv_heads,
                int64_t inter, int64_t max_pos) {
  ModelSpec s;
  s.name = name;
  s.family = ModelFamily::Decoder;
  s.vocab_size = vocab;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.intermediate_size = inter;
  s.max_positions = max_pos;
  s.mlp = MlpKind::SwiGlu;
  s.norm = NormKind::RmsNorm;
  s.tied_embeddings = false;
  s.learned_positions = false;  // RoPE
  s.softmax_upcast = true;
  return s;
}

ModelSpec bert(const char* name, int64_t h, int64_t layers, int64_t heads, int64_t inter) {
  ModelSpec s;
  s.name = name;
  s.family = ModelFamily::Encoder;
  s.vocab_size = 30522;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = heads;
  s.intermediate_size = inter;
  s.max_positions = 512;
  s.type_vocab_size = 2;
  s.mlp = MlpKind::Gelu;
  s.norm = NormKind::LayerNorm;
  s.learned_positions = true;
  s.linear_bias = true;
  s.dropout = true;  // hidden and attention dropout 0.1
  s.attention_dropout = true;
  s.masked_lm_head = false;  // BertModel: counts match HF's 109,482,240 for bert-base
  return s;
}

const std::vector<ModelSpec>& all_presets() {
  static const std::vector<ModelSpec> presets = {
      gpt2("gpt2", 768, 12, 12),
      gpt2("gpt2-medium", 1024, 24, 16),
      gpt2("gpt2-large", 1280, 36, 20),
      gpt2("gpt2-xl", 1600, 48, 25),
      llama("llama-2-7b", 32000, 4096, 32, 32, 32, 11008, 4096),
      llama("llama-2-13b", 32000, 5120, 40, 40, 40, 13824, 4096),
      llama("llama-2-70b", 32000, 8192, 80, 64, 8, 28672, 4096),
      llama("llama-3-8b", 128256, 4096, 32, 32, 8, 14336, 8192),
      llama("mistral-7b", 32000, 4096, 32, 32, 8, 14336, 32768),
      // Model families read from config.json text (preset_configs.cpp)
      preset_from_config("llama-3.2-1b"),
      preset_from_config("llama-3.2-3b"),
      preset_from_config("tinyllama-1.1b"),
      preset_from_config("gemma-2-2b"),
      preset_from_config("gemma-2-9b"),
      preset_from_config("phi-3-mini"),
      preset_from_config("mixtral-8x7b"),
      preset_from_config("qwen1.5-moe-a2.7b"),
      preset_from_config("deepseek-v2-lite"),
      bert("bert-base", 768, 12, 12, 3072),
      bert("bert-large", 1024, 24, 16, 4096),
  };
  return presets;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

ModelSpec preset(std::string_view name) {
  const std::string key = lower(name);
  for (const auto& p : all_presets())
    if (p.name == key) return p;
  throw ArgumentError(fmt::format("model '{}' is not a preset; accepted: {}", printable(name),
                                  fmt::join(preset_names(), ", ")));
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : all_presets()) names.push_back(p.name);
  return names;
}

}  // namespace gpuops::estimator
