// Model families read from config.json (docs/estimator.md "Model families"): Gemma-2, Phi-3, Llama 3.2,
// Mixtral, Qwen2-MoE, DeepSeek-V2 (MLA), and model types the parser has not seen. Parameter counts are
// checked against transformers; MoE activation terms against hand arithmetic written out here.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"

namespace est = gpuops::estimator;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const gpuops::ArgumentError& e) {
    return e.what();
  }
  return "";
}

est::ModelSpec parse(const std::string& json) { return est::model_from_hf_config(json, "cfg"); }

struct Reference {
  const char* preset;
  const char* config;     // the checkpoint's config.json fields
  int64_t parameters;     // sum(p.numel() for p in model.parameters())
  int64_t tensors;        // len(list(model.parameters()))
  int64_t largest;        // max(p.numel() for p in model.parameters())
};

// Reference numbers: transformers 4.57.3, AutoModelForCausalLM.from_config(AutoConfig.for_model(...)) on the
// meta device, from these config values (copied from each checkpoint's config.json on the Hub). They agree
// with the published counts (Mixtral-8x7B 46.7B, Phi-3-mini 3.8B, gemma-2-9b 9.24B, DeepSeek-V2-Lite 15.7B).
const Reference kReferences[] = {
    {"llama-3.2-1b", R"({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
      "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
      "max_position_embeddings": 131072, "tie_word_embeddings": true})",
     1235814400, 146, 262668288},
    {"llama-3.2-3b", R"({"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
      "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
      "max_position_embeddings": 131072, "tie_word_embeddings": true})",
     3212749824, 254, 394002432},
    {"tinyllama-1.1b", R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
      "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
      "tie_word_embeddings": false})",
     1100048384, 201, 65536000},
    {"gemma-2-2b", R"({"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
      "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
      "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
      "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256})",
     2614341888, 288, 589824000},
    {"gemma-2-9b", R"({"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
      "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
      "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
      "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256})",
     9241705984, 464, 917504000},
    {"phi-3-mini", R"({"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
      "sliding_window": 2047, "tie_word_embeddings": false, "resid_pdrop": 0.0, "embd_pdrop": 0.0})",
     3821079552, 195, 98500608},
    {"mixtral-8x7b", R"({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
      "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": null})",
     46702792704, 995, 131072000},
    {"qwen1.5-moe-a2.7b", R"({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
      "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
      "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_attention_heads": 16,
      "num_key_value_heads": 16, "max_position_embeddings": 8192, "decoder_sparse_step": 1, "mlp_only_layers": [],
      "tie_word_embeddings": false})",
     14315784192, 4659, 311164928},
    {"deepseek-v2-lite", R"({"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
      "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
      "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
      "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": null, "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
      "tie_word_embeddings": false})",
     15706484224, 5291, 209715200},
};

TEST(ModelFamilies, ConfigsAndPresetsCountLikeTransformers) {
  for (const auto& r : kReferences) {
    const est::ModelSpec m = parse(r.config);
    EXPECT_EQ(est::parameter_count(m), r.parameters) << r.preset;
    EXPECT_EQ(est::parameter_tensor_count(m), r.tensors) << r.preset;
    EXPECT_EQ(est::largest_parameter_tensor(m), r.largest) << r.preset;
    const est::ModelSpec p = est::preset(r.preset);
    EXPECT_EQ(est::parameter_count(p), r.parameters) << r.preset;
    EXPECT_EQ(est::parameter_tensor_count(p), r.tensors) << r.preset;
  }
}

TEST(ModelFamilies, FieldsThatChangeWhatIsSaved) {
  const est::ModelSpec gemma = est::preset("gemma-2-2b");
  EXPECT_EQ(gemma.norms_per_layer, 4);
  EXPECT_TRUE(gemma.tied_embeddings);  // GemmaConfig ties by default
  EXPECT_TRUE(gemma.scaled_embeddings);
  EXPECT_EQ(gemma.mlp_activation, "gelu_pytorch_tanh");
  EXPECT_EQ(gemma.sliding_window, 4096);
  EXPECT_DOUBLE_EQ(gemma.attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(gemma.final_logit_softcapping, 30.0);
  const est::ModelSpec phi = est::preset("phi-3-mini");
  EXPECT_TRUE(phi.fused_qkv);
  EXPECT_TRUE(phi.fused_gate_up);
  // Fused layout, same count as unfused: LoRA names the slices.
  EXPECT_EQ(est::projection_shape(phi, "q").out_features, 3072);
  EXPECT_EQ(est::projection_shape(phi, "gate").out_features, 8192);
  // Qwen2: q, k, v biases; Llama's attention_bias puts one on o too, mlp_bias on gate, up, down.
  const std::string qwen2 = R"({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})";
  // per layer: q 64x64+64, k 64x32+32, v 64x32+32, o 64x64, gate/up 64x96, down 96x64, 2 norms of 64;
  // embeddings 100x64, untied head 100x64, final norm 64
  const int64_t qwen2_layer = (4096 + 64) + 2 * (2048 + 32) + 4096 + 3 * 6144 + 128;
  EXPECT_EQ(est::parameter_count(parse(qwen2)), 2 * qwen2_layer + 2 * 6400 + 64);
  const std::string llama_bias = R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "attention_bias": true, "mlp_bias": true})";
  EXPECT_EQ(est::parameter_count(parse(llama_bias)), 2 * (qwen2_layer + 64 + 2 * 96 + 64) + 2 * 6400 + 64);
}

TEST(ModelFamilies, SoftcappingSavesTheTanhOutputs) {
  est::ModelSpec capped = est::preset("gemma-2-2b");
  est::ModelSpec plain = capped;
  plain.attn_logit_softcapping = 0;
  plain.final_logit_softcapping = 0;
  est::TrainingSetup t;
  t.precision = est::Precision::Bf16Mixed;
  t.micro_batch = 2;
  t.seq_len = 128;
  t.attention = est::AttentionKind::Eager;
  const est::ForwardSaved a = est::forward_saved(capped, t, est::cuda_device());
  const est::ForwardSaved b = est::forward_saved(plain, t, est::cuda_device());
  // One bf16 s x s tanh output per head and layer: 26 layers x (2 x 8 x 128 x 128) x 2 bytes.
  EXPECT_EQ(a.layers - b.layers, int64_t{26} * 2 * 8 * 128 * 128 * 2);
  // The logits' tanh: N x V x 2 bytes, N = 2 x 128.
  EXPECT_EQ(a.loss - b.loss, int64_t{256} * 256000 * 2);
  // sdpa / flash: the cap is not applied there (transformers 4.57) and saves nothing.
  t.attention = est::AttentionKind::Flash;
  EXPECT_EQ(est::forward_saved(capped, t, est::cuda_device()).layers,
            est::forward_saved(plain, t, est::cuda_device()).layers);
  EXPECT_FALSE(capped.assumptions.empty());
}

// A tiny Mixtral: h 64, 4 experts of width 128, top-2, 2 layers.
const char* kTinyMixtral = R"({"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 64,
  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 256, "num_local_experts": 4, "num_experts_per_tok": 2})";

TEST(ModelFamilies, MoeWeightsCountEveryExpert) {
  const est::ModelSpec m = parse(kTinyMixtral);
  // Per layer: q 64x64, k and v 64x32, o 64x64; two norms of 64; router 64x4; 4 experts x 3 x 64x128.
  const int64_t layer = 4096 + 2 * 2048 + 4096 + 2 * 64 + 64 * 4 + 4 * 3 * 64 * 128;
  EXPECT_EQ(est::parameter_count(m), 2 * layer + 2 * 1000 * 64 + 64);  // + embeddings, head, final norm
  EXPECT_EQ(est::moe_layer_count(m), 2);
  // Full fine-tuning keeps gradients and Adam states of every expert: on CUDA 4 + 8 bytes per parameter (fp32).
  est::TrainingSetup t;
  t.precision = est::Precision::Fp32;
  const est::MemoryBreakdown p = est::persistent_memory(m, t, est::cuda_device());
  EXPECT_EQ(p.gradients, 4 * est::parameter_count(m));
  EXPECT_EQ(p.optimizer_states, 8 * est::parameter_count(m));
}

TEST(ModelFamilies, MoeActivationsAreTheRoutedTopK) {
  // fp32 on the CPU: every saved tensor 4 bytes per value. The MoE model against the same model with a
  // dense SwiGLU MLP of the expert width: only the MLP halves differ.
  const std::string dense_json = R"({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256})";
  est::TrainingSetup t;
  t.precision = est::Precision::Fp32;
  t.micro_batch = 2;
  t.seq_len = 8;
  const int64_t N = 16, h = 64, I = 128, E = 4, L = 2;
  const est::ModelSpec moe = parse(kTinyMixtral);
  const est::ModelSpec dense = parse(dense_json);
  const int64_t dense_mlp = 4 * N * I * 4;  // gate, up, silu(gate), product
  // Each of the k·N routed rows: gathered input (h), gate, up, silu(gate), product (4·I), the expert output the
  // routing weight multiplies (h), the weighted output index_add_ keeps (h), its token and slot indices (2 int64)
  // and weight (fp32); the router's fp32 softmax (N x E), top-k indices (int64), and as Mixtral renormalises,
  // the fp32 top-k weights and their sum (N).
  auto moe_mlp = [&](int64_t k) {
    return k * N * (h * 4 + 4 * I * 4 + h * 4 + h * 4 + 16 + 4) + N * E * 4 + N * k * 8 + N * k * 4 + N * 4;
  };
  // Measured: the bytes of the tensors autograd saves (saved_tensors_hooks, distinct storages, parameters
  // excluded) in transformers 4.57.3's MixtralSparseMoeBlock for this shape in fp32: 91,456.
  EXPECT_EQ(moe_mlp(2), 91456);
  const est::ForwardSaved a = est::forward_saved(moe, t, est::cpu_device());
  const est::ForwardSaved b = est::forward_saved(dense, t, est::cpu_device());
  EXPECT_EQ(a.layers - b.layers, L * (moe_mlp(2) - dense_mlp));
  EXPECT_EQ(a.block_mlp, moe_mlp(2));
  // Routed top-k, not all experts: top-1 saves one expert pass per token less; all four would be far more.
  est::ModelSpec top1 = moe;
  top1.experts_per_token = 1;
  EXPECT_EQ(est::forward_saved(top1, t, est::cpu_device()).layers, a.layers - L * (moe_mlp(2) - moe_mlp(1)));
  EXPECT_LT(moe_mlp(2), moe_mlp(4));
  // Checkpointed blocks keep only their input, MoE or not.
  t.checkpoint = est::CheckpointKind::Full;
  EXPECT_EQ(est::forward_saved(moe, t, est::cpu_device()).layers,
            est::forward_saved(dense, t, est::cpu_device()).layers);
}

TEST(ModelFamilies, QwenMoeSharedExpertAndLayers) {
  // 3 layers, decoder_sparse_step 1, layer 1 dense (mlp_only_layers): 2 MoE layers.
  const std::string json = R"({"model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "mlp_only_layers": [1]})";
  const est::ModelSpec m = parse(json);
  EXPECT_EQ(est::moe_layer_count(m), 2);
  EXPECT_FALSE(est::is_moe_layer(m, 1));
  // attention with q, k, v biases: 4 x 64x64 + 3 x 64; norms 2 x 64
  const int64_t attention = 4 * 4096 + 3 * 64, norms = 128;
  const int64_t dense_mlp = 3 * 64 * 96;
  // router 64x8, 8 experts x 3 x 64x32, shared expert 3 x 64x48, shared_expert_gate 64x1
  const int64_t moe_mlp = 64 * 8 + 8 * 3 * 64 * 32 + 3 * 64 * 48 + 64;
  EXPECT_EQ(est::parameter_count(m), 3 * (attention + norms) + dense_mlp + 2 * moe_mlp + 2 * 64000 + 64);
  // Activations (fp32, CPU): the shared expert adds a SwiGLU of width 48 on every token and the gate's
  // sigmoid output (N) and the shared output it multiplies (N x h).
  est::TrainingSetup t;
  t.precision = est::Precision::Fp32;
  t.micro_batch = 1;
  t.seq_len = 16;
  const int64_t N = 16, h = 64, k = 2, E = 8, Im = 32, S = 48;
  // (norm_topk_prob false: no renormalised weights)
  const int64_t expected = k * N * (h * 4 + 4 * Im * 4 + h * 4 + h * 4 + 20) + N * E * 4 + N * k * 8 +
                           4 * N * S * 4 + N * h * 4 + N * 4;
  // Measured as above on transformers 4.57.3's Qwen2MoeSparseMoeBlock with this shape in fp32: 58,816.
  EXPECT_EQ(expected, 58816);
  EXPECT_EQ(est::forward_saved(m, t, est::cpu_device()).block_mlp, expected);  // the last layer is MoE
}

TEST(ModelFamilies, DeepseekMlaAndLoraTargets) {
  const est::ModelSpec m = est::preset("deepseek-v2-lite");
  EXPECT_TRUE(est::is_mla(m));
  EXPECT_EQ(est::moe_layer_count(m), 26);  // first_k_dense_replace 1
  // MLA, q_lora_rank null: q_proj 2048 x 16·192, kv_a 2048 x (512 + 64), kv_b 512 x 16·(128 + 128), o 16·128 x 2048,
  // kv_a_layernorm 512.
  const int64_t attention = 2048 * 3072 + 2048 * 576 + 512 * 4096 + 2048 * 2048 + 512;
  EXPECT_EQ(est::parameter_groups(m).attention_per_layer, attention);
  // LoRA on a MoE model targets the attention only; MLA's projections have their own names.
  const auto names = est::projection_names(m);
  EXPECT_EQ(names, (std::vector<std::string>{"q", "kv_a", "kv_b", "o"}));
  est::LoraSetup lora;
  lora.rank = 8;
  lora.targets = {"q", "kv_b"};
  EXPECT_EQ(est::lora_parameter_count(m, lora), 27 * 8 * ((2048 + 3072) + (512 + 4096)));
  const std::string msg = error_of([&] { est::projection_shape(m, "gate"); });
  EXPECT_NE(msg.find("kv_a"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { est::projection_shape(est::preset("mixtral-8x7b"), "up"); }).find("q,k,v,o"),
            std::string::npos);
  EXPECT_NO_THROW(est::projection_shape(est::preset("mixtral-8x7b"), "v"));
}

TEST(ModelFamilies, UnknownModelTypeIsReadByTheStandardFields) {
  const est::ModelSpec m = parse(R"({"model_type": "foo", "vocab_size": 1000, "d_model": 64, "n_layer": 2,
    "n_head": 4, "ffn_dim": 128, "max_position_embeddings": 512})");
  EXPECT_EQ(m.model_type, "foo");
  EXPECT_EQ(m.hidden_size, 64);
  EXPECT_EQ(m.num_layers, 2);
  EXPECT_EQ(m.intermediate_size, 128);
  ASSERT_FALSE(m.assumptions.empty());
  EXPECT_NE(m.assumptions.front().find("model_type 'foo' is not known"), std::string::npos) << m.assumptions.front();
  EXPECT_NE(m.assumptions.front().find("untied"), std::string::npos);
  // Llama-style: 4 x 64x64 attention, 3 x 64x128 MLP, 2 RMSNorms; untied embeddings and head; final norm.
  EXPECT_EQ(est::parameter_count(m), 2 * (4 * 4096 + 3 * 8192 + 128) + 2 * 64000 + 64);
  // An unknown type with experts is read Mixtral-style, and says so.
  const est::ModelSpec moe = parse(R"({"model_type": "bar", "vocab_size": 1000, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "num_local_experts": 4,
    "num_experts_per_tok": 2})");
  EXPECT_EQ(est::parameter_count(moe), est::parameter_count(parse(kTinyMixtral)) + 2 * 2 * 2048);  // k, v 64x64: 4 kv heads
  EXPECT_EQ(moe.assumptions.size(), 2u);
  // Known types make no assumptions.
  EXPECT_TRUE(est::preset("llama-3.2-1b").assumptions.empty());
  EXPECT_TRUE(est::preset("mixtral-8x7b").assumptions.empty());
}

TEST(ModelFamilies, BadConfigsNameTheKey) {
  auto refused = [](const std::string& json, const char* key) {
    const std::string msg = error_of([&] { parse(json); });
    EXPECT_NE(msg.find(key), std::string::npos) << "expected '" << key << "' in: " << msg;
  };
  // Missing keys, with the aliases the unknown type would also read.
  refused(R"({"model_type": "foo", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2})", "'intermediate_size' is missing");
  refused(R"({"model_type": "foo", "vocab_size": 10, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 8})", "n_embd, d_model");
  refused(R"({"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 8, "num_experts_per_tok": 2})", "'num_local_experts'");
  refused(R"({"model_type": "deepseek_v2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 8, "kv_lora_rank": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
    "n_routed_experts": null})", "'q_lora_rank'");
  // Top-k above the number of experts, zero and negative sizes.
  refused(R"({"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 5})",
          "num_experts_per_tok must be from 1 to num_experts (4), got 5");
  refused(R"({"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 1,
    "moe_intermediate_size": 0})", "'moe_intermediate_size'");
  refused(R"({"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 8, "num_local_experts": -1, "num_experts_per_tok": 1})",
          "'num_local_experts'");
  refused(R"({"model_type": "gemma2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 0})", "'intermediate_size'");
  refused(R"({"model_type": "gemma2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 8, "attn_logit_softcapping": -1})", "attn_logit_softcapping");
  refused(R"({"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 1,
    "moe_intermediate_size": 4, "mlp_only_layers": [0, -1]})", "'mlp_only_layers'");
  // Not decoders: refused, not misread.
  refused(R"({"model_type": "bart", "vocab_size": 10, "d_model": 8})", "encoder-decoder");
  refused(R"({"model_type": "foo", "is_encoder_decoder": true, "vocab_size": 10})", "'foo' is an encoder-decoder");
}

TEST(ModelFamilies, CliPrintsTheAssumptionsAndJsonHasThem) {
  const std::string path = ::testing::TempDir() + "/gpuops_models_foo.json";
  {
    std::ofstream f(path);
    f << R"({"model_type": "foo", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128})";
  }
  const auto text = gpuops::testing::run_cli({"estimate", "--config", path, "--seq", "64"});
  EXPECT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("note: model_type 'foo' is not known"), std::string::npos) << text.out;
  const auto js = gpuops::testing::run_cli({"estimate", "--config", path, "--seq", "64", "--json"});
  ASSERT_EQ(js.code, 0) << js.err;
  const auto model = nlohmann::json::parse(js.out)["runs"][0]["model"];
  EXPECT_EQ(model["model_type"], "foo");
  ASSERT_EQ(model["assumptions"].size(), 1u);
  const auto moe = gpuops::testing::run_cli({"estimate", "--model", "mixtral-8x7b", "--seq", "64", "--json"});
  ASSERT_EQ(moe.code, 0) << moe.err;
  const auto mixtral = nlohmann::json::parse(moe.out)["runs"][0]["model"];
  EXPECT_EQ(mixtral["parameters"], 46702792704);
  EXPECT_EQ(mixtral["num_experts"], 8);
  EXPECT_EQ(mixtral["moe_layers"], 32);
  EXPECT_TRUE(mixtral["assumptions"].empty());
}

}  // namespace

// A model by name: a preset, else a Hub id from the local Hugging Face cache (refs/main's snapshot), never a
// path out of it; the default sequence is 2048 or the learned position table when shorter.
TEST(ModelFamilies, ByNameReadsPresetsAndTheLocalHubCache) {
  namespace fs = std::filesystem;
  const fs::path cache = fs::temp_directory_path() / ("gpuops-hub-" + std::to_string(::getpid()));
  const fs::path repo = cache / "models--org--tiny";
  fs::create_directories(repo / "refs");
  std::ofstream(repo / "refs" / "main") << "abc123\n";
  for (const char* revision : {"abc123", "zzz999"}) {  // zzz999 is newer on disk; refs/main still wins
    fs::create_directories(repo / "snapshots" / revision);
    std::ofstream(repo / "snapshots" / revision / "config.json")
        << R"({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "max_position_embeddings": 777, "num_hidden_layers": )"
        << (std::string(revision) == "abc123" ? 3 : 1) << "}";
  }
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  const est::ModelSpec tiny = est::model_by_name("org/tiny");
  EXPECT_EQ(tiny.num_layers, 3);
  EXPECT_EQ(tiny.name, "org/tiny");
  EXPECT_EQ(est::default_seq_len(tiny), est::kDefaultSeqLen);  // rotary: 777 positions do not bound it
  EXPECT_EQ(est::default_seq_len(est::model_by_name("llama-3.2-1b")), est::kDefaultSeqLen);
  EXPECT_EQ(est::default_seq_len(est::model_by_name("gpt2")), 1024);
  for (const char* bad : {"org/absent", "../tiny", "org/../org/tiny", "a/b/c", ""})
    EXPECT_NE(error_of([&] { est::model_by_name(bad); }).find("nor a Hugging Face Hub id"), std::string::npos) << bad;
  ::unsetenv("HF_HUB_CACHE");
  fs::remove_all(cache);
}
