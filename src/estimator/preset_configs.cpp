// Presets of the newer families, kept as the config.json fields that matter, copied from each checkpoint's
// config.json on the Hugging Face Hub, and read by the same parser as --config (so a preset and its
// config.json agree by construction). Their parameter counts are pinned in tests/cpp/test_estimator_models.cpp.
#include "preset_configs.h"

#include <fmt/format.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/hf_config.h"

namespace gpuops::estimator {
namespace {

struct PresetConfig {
  const char* name;
  const char* json;
};

constexpr PresetConfig kConfigs[] = {
    // meta-llama/Llama-3.2-1B
    {"llama-3.2-1b", R"({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
      "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 64, "max_position_embeddings": 131072, "tie_word_embeddings": true, "attention_bias": false,
      "mlp_bias": false, "hidden_act": "silu"})"},
    // meta-llama/Llama-3.2-3B
    {"llama-3.2-3b", R"({"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072,
      "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
      "head_dim": 128, "max_position_embeddings": 131072, "tie_word_embeddings": true, "attention_bias": false,
      "mlp_bias": false, "hidden_act": "silu"})"},
    // TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
    {"tinyllama-1.1b", R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
      "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
      "max_position_embeddings": 2048, "tie_word_embeddings": false, "hidden_act": "silu"})"},
    // google/gemma-2-2b
    {"gemma-2-2b", R"({"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
      "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
      "head_dim": 256, "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh",
      "hidden_act": "gelu_pytorch_tanh", "sliding_window": 4096, "attn_logit_softcapping": 50.0,
      "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256, "attention_bias": false,
      "attention_dropout": 0.0})"},
    // google/gemma-2-9b
    {"gemma-2-9b", R"({"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584,
      "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
      "head_dim": 256, "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh",
      "hidden_act": "gelu_pytorch_tanh", "sliding_window": 4096, "attn_logit_softcapping": 50.0,
      "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256, "attention_bias": false,
      "attention_dropout": 0.0})"},
    // microsoft/Phi-3-mini-4k-instruct (3.8B)
    {"phi-3-mini", R"({"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
      "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "sliding_window": 2047,
      "tie_word_embeddings": false, "hidden_act": "silu", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
      "attention_dropout": 0.0})"},
    // mistralai/Mixtral-8x7B-v0.1
    {"mixtral-8x7b", R"({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
      "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
      "sliding_window": null, "tie_word_embeddings": false, "hidden_act": "silu"})"},
    // Qwen/Qwen1.5-MoE-A2.7B
    {"qwen1.5-moe-a2.7b", R"({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
      "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
      "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_attention_heads": 16,
      "num_key_value_heads": 16, "max_position_embeddings": 8192, "decoder_sparse_step": 1,
      "norm_topk_prob": false, "use_sliding_window": false, "sliding_window": 32768,
      "tie_word_embeddings": false, "hidden_act": "silu"})"},
    // deepseek-ai/DeepSeek-V2-Lite
    {"deepseek-v2-lite", R"({"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
      "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
      "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
      "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": null,
      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "max_position_embeddings": 163840, "tie_word_embeddings": false, "attention_bias": false,
      "topk_method": "greedy", "hidden_act": "silu"})"},
};

}  // namespace

ModelSpec preset_from_config(std::string_view name) {
  for (const auto& c : kConfigs)
    if (name == c.name) return model_from_hf_config(c.json, c.name);
  throw ArgumentError(fmt::format("preset '{}' has no config.json in preset_configs.cpp", name));
}

}  // namespace gpuops::estimator
