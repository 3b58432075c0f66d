// The analytic VRAM estimator: parameter counts against Hugging Face, config parsing, ZeRO and LoRA
// arithmetic, activation model properties, GPU catalog fitting. Torch-free.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <string>

#include "gpuops/errors.h"
#include "gpuops/estimator.h"

namespace est = gpuops::estimator;
using gpuops::ArgumentError;

namespace {

// Runs `f`, expects ArgumentError, returns its message.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ArgumentError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ArgumentError thrown";
  return {};
}

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

est::TrainingSetup full_bf16_mixed() {
  est::TrainingSetup s;
  s.precision = est::Precision::Bf16Mixed;
  s.optimizer = est::OptimizerKind::AdamW;
  s.micro_batch = 1;
  s.seq_len = 1024;
  return s;
}

}  // namespace

// ---------------------------------------------------------------- parameter counts

TEST(Presets, ParameterCountsMatchHuggingFace) {
  // sum(p.numel() for p in model.parameters()) of the HF classes (tied weights counted once).
  EXPECT_EQ(est::parameter_count(est::preset("gpt2")), 124439808);
  EXPECT_EQ(est::parameter_count(est::preset("gpt2-medium")), 354823168);
  EXPECT_EQ(est::parameter_count(est::preset("gpt2-large")), 774030080);
  EXPECT_EQ(est::parameter_count(est::preset("gpt2-xl")), 1557611200);
  EXPECT_EQ(est::parameter_count(est::preset("llama-2-7b")), 6738415616);
  EXPECT_EQ(est::parameter_count(est::preset("llama-2-13b")), 13015864320);
  EXPECT_EQ(est::parameter_count(est::preset("llama-2-70b")), 68976648192);
  EXPECT_EQ(est::parameter_count(est::preset("llama-3-8b")), 8030261248);
  EXPECT_EQ(est::parameter_count(est::preset("mistral-7b")), 7241732096);
  EXPECT_EQ(est::parameter_count(est::preset("bert-base")), 109482240);   // BertModel
  EXPECT_EQ(est::parameter_count(est::preset("bert-large")), 335141888);  // BertModel
}

TEST(Presets, MaskedLmHeadCountsBertForMaskedLM) {
  est::ModelSpec bert = est::preset("bert-base");
  bert.masked_lm_head = true;
  EXPECT_EQ(est::parameter_count(bert), 109514298);
}

TEST(Presets, GroupsSumToTotalAndEveryPresetValidates) {
  for (const auto& name : est::preset_names()) {
    const est::ModelSpec m = est::preset(name);
    EXPECT_NO_THROW(est::validate(m)) << name;
    EXPECT_EQ(est::parameter_groups(m).total(), est::parameter_count(m)) << name;
  }
  EXPECT_EQ(est::preset_names().size(), 20u);  // + 9 model-family presets (test_estimator_models.cpp)
}

TEST(Presets, LookupIgnoresCaseAndRejectsUnknownNames) {
  EXPECT_EQ(est::preset("GPT2").name, "gpt2");
  const std::string msg = error_of([] { est::preset("gpt5"); });
  EXPECT_NE(msg.find("'gpt5'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama-2-7b"), std::string::npos) << msg;
}

TEST(ModelSpec, ProjectionShapesFollowGqa) {
  const est::ModelSpec m = est::preset("llama-3-8b");
  EXPECT_EQ(est::projection_shape(m, "q").out_features, 4096);
  EXPECT_EQ(est::projection_shape(m, "k").out_features, 1024);  // 8 kv heads x 128
  EXPECT_EQ(est::projection_shape(m, "down").in_features, 14336);
  EXPECT_THROW(est::projection_shape(est::preset("gpt2"), "gate"), ArgumentError);
}

TEST(ModelSpec, ValidateNamesTheBadField) {
  est::ModelSpec m = est::preset("gpt2");
  m.num_kv_heads = 5;  // does not divide 12
  EXPECT_NE(error_of([&] { est::validate(m); }).find("num_kv_heads"), std::string::npos);
  m = est::preset("gpt2");
  m.hidden_size = 0;
  EXPECT_NE(error_of([&] { est::validate(m); }).find("hidden_size"), std::string::npos);
}

TEST(ModelSpec, ParamCountSuffixes) {
  EXPECT_EQ(est::parse_param_count("7B"), 7000000000);
  EXPECT_EQ(est::parse_param_count("1.5b"), 1500000000);
  EXPECT_EQ(est::parse_param_count("125M"), 125000000);
  EXPECT_EQ(est::parse_param_count("350k"), 350000);
  EXPECT_EQ(est::parse_param_count("6738415616"), 6738415616);
  for (const char* bad : {"7X", "0", "-5", "", "B", "7BB", "0.0001"}) {
    const std::string msg = error_of([&] { est::parse_param_count(bad); });
    EXPECT_NE(msg.find("params"), std::string::npos) << bad << ": " << msg;
  }
}

// ---------------------------------------------------------------- config.json

TEST(HfConfig, Gpt2ConfigMatchesPreset) {
  const std::string path = write_temp("gpt2_config.json", R"({
    "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_inner": null, "n_positions": 1024, "resid_pdrop": 0.1, "architectures": ["GPT2LMHeadModel"]})");
  const est::ModelSpec m = est::model_from_hf_config_file(path);
  EXPECT_EQ(est::parameter_count(m), 124439808);
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_EQ(m.name, path);
}

TEST(HfConfig, LlamaMistralAndQwen2) {
  const est::ModelSpec llama = est::model_from_hf_config(R"({"model_type": "llama", "vocab_size": 32000,
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
    "max_position_embeddings": 4096})", "llama");
  EXPECT_EQ(est::parameter_count(llama), 6738415616);  // num_key_value_heads defaults to the heads
  EXPECT_FALSE(llama.tied_embeddings);
  const est::ModelSpec mistral = est::model_from_hf_config(R"({"model_type": "mistral", "vocab_size": 32000,
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "tie_word_embeddings": false})", "mistral");
  EXPECT_EQ(est::parameter_count(mistral), 7241732096);
  // Qwen2-0.5B: q/k/v biases and tied embeddings; HF reports 494,032,768 parameters.
  const est::ModelSpec qwen = est::model_from_hf_config(R"({"model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "tie_word_embeddings": true})", "qwen");
  EXPECT_EQ(est::parameter_count(qwen), 494032768);
}

TEST(HfConfig, BertHeadFollowsArchitectures) {
  const std::string base = R"("model_type": "bert", "vocab_size": 30522, "hidden_size": 768,
    "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "max_position_embeddings": 512, "type_vocab_size": 2)";
  EXPECT_EQ(est::parameter_count(est::model_from_hf_config("{" + base + "}", "b")), 109482240);
  EXPECT_EQ(est::parameter_count(
                est::model_from_hf_config("{" + base + R"(, "architectures": ["BertForMaskedLM"]})", "b")),
            109514298);
}

TEST(HfConfig, ErrorsNameTheFileAndTheKey) {
  const std::string missing_file = ::testing::TempDir() + "no_such_config.json";
  std::string msg = error_of([&] { est::model_from_hf_config_file(missing_file); });
  EXPECT_NE(msg.find(missing_file), std::string::npos) << msg;

  const std::string bad_json = write_temp("bad.json", "{\"model_type\": \"gpt2\", ");
  msg = error_of([&] { est::model_from_hf_config_file(bad_json); });
  EXPECT_NE(msg.find(bad_json), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;

  const std::string no_key = write_temp("nokey.json", R"({"model_type": "gpt2", "vocab_size": 50257,
    "n_layer": 12, "n_head": 12, "n_positions": 1024})");
  msg = error_of([&] { est::model_from_hf_config_file(no_key); });
  EXPECT_NE(msg.find(no_key), std::string::npos) << msg;
  EXPECT_NE(msg.find("'n_embd'"), std::string::npos) << msg;

  msg = error_of([] { est::model_from_hf_config(R"({"model_type": "t5", "d_model": 512})", "t5cfg"); });
  EXPECT_NE(msg.find("'t5'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama"), std::string::npos) << msg;

  msg = error_of([] { est::model_from_hf_config(R"({"model_type": "llama", "vocab_size": 32000,
    "hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 8})", "c"); });
  EXPECT_NE(msg.find("'hidden_size'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"big\""), std::string::npos) << msg;

  msg = error_of([] { est::model_from_hf_config(R"([1, 2])", "arr"); });
  EXPECT_NE(msg.find("arr"), std::string::npos) << msg;
  msg = error_of([] { est::model_from_hf_config(R"({"vocab_size": 3})", "nomt"); });
  EXPECT_NE(msg.find("model_type"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- training setup

TEST(TrainingSetup, ParseAndPrintRoundTrip) {
  for (const char* p : {"fp32", "fp16-mixed", "bf16-mixed", "bf16"})
    EXPECT_EQ(est::to_string(est::parse_precision(p)), p);
  for (const char* o : {"adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit"})
    EXPECT_EQ(est::to_string(est::parse_optimizer(o)), o);
  est::TrainingSetup s;
  est::parse_checkpointing("every:4", s);
  EXPECT_EQ(s.checkpoint, est::CheckpointKind::EveryK);
  EXPECT_EQ(s.checkpoint_every_k, 4);
  EXPECT_EQ(est::checkpointing_to_string(s), "every:4");
  for (const char* bad : {"every:0", "every:", "every:x", "sometimes"})
    EXPECT_NE(error_of([&] { est::parse_checkpointing(bad, s); }).find("checkpointing"), std::string::npos);
  EXPECT_NE(error_of([] { est::parse_precision("fp8"); }).find("bf16-mixed"), std::string::npos);
}

TEST(TrainingSetup, ValidateRejectsBadSettings) {
  const est::ModelSpec gpt2 = est::preset("gpt2");
  auto message = [&](auto change) {
    est::TrainingSetup s = full_bf16_mixed();
    change(s);
    return error_of([&] { est::validate(s, gpt2); });
  };
  EXPECT_NE(message([](auto& s) { s.micro_batch = 0; }).find("batch"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.seq_len = -1; }).find("seq"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.seq_len = 2048; }).find("1024"), std::string::npos);  // learned positions
  EXPECT_NE(message([](auto& s) { s.grad_accum = 0; }).find("grad-accum"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.num_gpus = 0; }).find("gpus"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.zero_stage = 4; }).find("zero"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.lora.rank = 769; }).find("768"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.lora.rank = 8, s.lora.targets = {"gate"}; }).find("gate"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.lora.rank = 8, s.lora.targets = {"q", "q"}; }).find("twice"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.lora.base = est::BaseWeightDtype::Nf4; }).find("base-dtype"), std::string::npos);
  EXPECT_NE(message([](auto& s) { s.checkpoint = est::CheckpointKind::EveryK, s.checkpoint_every_k = 13; })
                .find("every:13"), std::string::npos);
  // ZeRO with one GPU is allowed (it saves nothing); a long sequence is fine for RoPE models.
  est::TrainingSetup ok = full_bf16_mixed();
  ok.zero_stage = 3;
  ok.seq_len = 100000;
  EXPECT_NO_THROW(est::validate(ok, est::preset("llama-2-7b")));
  est::TrainingSetup lora = full_bf16_mixed();
  lora.lora.rank = 8;
  EXPECT_THROW(est::validate(lora, est::params_only_model(7000000000)), ArgumentError);
}

// ---------------------------------------------------------------- persistent state

// Persistent bytes (weights, gradients, master, states) on CUDA: no per-tensor host-side 'step' scalars.
static est::MemoryBreakdown persistent(const est::ModelSpec& m, const est::TrainingSetup& s) {
  return est::persistent_memory(m, s, est::cuda_device());
}

TEST(Estimate, FullFineTuneBytesPerParameter) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  const int64_t P = 6738415616, inv_freq = 64 * 4;  // RoPE buffer: head_dim/2 fp32 values
  est::TrainingSetup s = full_bf16_mixed();
  // torch.autocast: fp32 weights, gradients and states, no master copy.
  est::MemoryBreakdown b = persistent(m, s);
  EXPECT_EQ(b.weights, 4 * P + inv_freq);
  EXPECT_EQ(b.gradients, 4 * P);
  EXPECT_EQ(b.master_weights, 0);
  EXPECT_EQ(b.optimizer_states, 8 * P);
  // Master-copy layout: 16-bit weights and gradients, fp32 master and states (the same 16 bytes/param).
  s.amp = est::AmpLayout::MasterCopy;
  b = persistent(m, s);
  EXPECT_EQ(b.weights, 2 * P + inv_freq + 64 * 2);  // + the bf16 inv_freq beside the fp32 original
  EXPECT_EQ(b.gradients, 2 * P);
  EXPECT_EQ(b.master_weights, 4 * P);
  EXPECT_EQ(b.optimizer_states, 8 * P);
  // On the CPU torch keeps AdamW's fp32 'step' per parameter tensor with the states: 1 + 9·32 + 1 + 1.
  EXPECT_EQ(est::persistent_memory(m, s, est::cpu_device()).optimizer_states, 8 * P + 4 * 291);
  EXPECT_EQ(est::parameter_tensor_count(m), 291);

  s = full_bf16_mixed();
  s.precision = est::Precision::Fp32;
  b = persistent(m, s);
  EXPECT_EQ(b.weights, 4 * P + inv_freq);
  EXPECT_EQ(b.gradients, 4 * P);
  EXPECT_EQ(b.master_weights, 0);
  s.precision = est::Precision::Bf16Pure;
  s.optimizer = est::OptimizerKind::SgdMomentum;
  b = persistent(m, s);
  EXPECT_EQ(b.master_weights, 0);
  EXPECT_EQ(b.optimizer_states, 2 * P);  // bf16 momentum buffer
  s.optimizer = est::OptimizerKind::Sgd;
  EXPECT_EQ(persistent(m, s).optimizer_states, 0);
  s.precision = est::Precision::Bf16Mixed;
  s.optimizer = est::OptimizerKind::AdamW8bit;
  b = persistent(m, s);
  EXPECT_GT(b.optimizer_states, 2 * P);
  EXPECT_LT(b.optimizer_states, 2 * P + P / 100);  // block scales are under 1%
}

TEST(Estimate, ZeroStagesPartitionByNumGpus) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  const int64_t P = 6738415616, shard = (P + 3) / 4, buffers = 64 * 4 + 64 * 2;
  est::TrainingSetup s = full_bf16_mixed();
  s.amp = est::AmpLayout::MasterCopy;
  s.num_gpus = 4;
  auto at = [&](int stage) {
    s.zero_stage = stage;
    return persistent(m, s);
  };
  const est::MemoryBreakdown z0 = at(0), z1 = at(1), z2 = at(2), z3 = at(3);
  EXPECT_EQ(z0.optimizer_states, 8 * P);
  EXPECT_EQ(z1.optimizer_states, 8 * shard);
  EXPECT_EQ(z1.master_weights, 4 * shard);
  EXPECT_EQ(z1.gradients, 2 * P);
  EXPECT_EQ(z2.gradients, 2 * shard);
  EXPECT_EQ(z2.weights, 2 * P + buffers);
  EXPECT_EQ(z3.weights, 2 * shard + buffers);
  EXPECT_LT(z3.total(), z2.total());
  EXPECT_LT(z2.total(), z1.total());
  EXPECT_LT(z1.total(), z0.total());
  // The peak follows: ZeRO-3 on 4 GPUs needs far less per GPU than stage 0.
  s.zero_stage = 3;
  const int64_t peak_z3 = est::estimate_memory(m, s, est::cuda_device()).total();
  s.zero_stage = 0;
  EXPECT_LT(peak_z3 * 2, est::estimate_memory(m, s, est::cuda_device()).total());
  // One GPU: every stage is the same as stage 0, but for DeepSpeed ZeRO-3's gradient bucket (made on one GPU too:
  // 5e8 bf16 elements by default).
  s.num_gpus = 1;
  s.zero_stage = 3;
  const int64_t one_gpu_z3 = est::estimate_memory(m, s, est::cpu_device()).total();
  s.ds_reduce_bucket = 0;
  const int64_t one_gpu_z3_no_bucket = est::estimate_memory(m, s, est::cpu_device()).total();
  s.zero_stage = 0;
  s.ds_reduce_bucket = est::TrainingSetup{}.ds_reduce_bucket;
  const int64_t one_gpu_z0 = est::estimate_memory(m, s, est::cpu_device()).total();
  EXPECT_EQ(one_gpu_z3_no_bucket, one_gpu_z0);
  EXPECT_EQ(one_gpu_z3 - one_gpu_z0, int64_t{500'000'000} * 2);
}

TEST(Estimate, LoraTrainsOnlyTheAdapters) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  est::LoraSetup lora;
  lora.rank = 8;
  lora.targets = {"q", "v"};
  EXPECT_EQ(est::lora_parameter_count(m, lora), 4194304);  // PEFT's "trainable params: 4,194,304"
  lora.rank = 16;
  lora.targets = {"q", "k", "v", "o"};
  EXPECT_EQ(est::lora_parameter_count(m, lora), 16777216);

  est::TrainingSetup full = full_bf16_mixed();
  est::TrainingSetup s = full;
  s.lora = lora;
  const est::MemoryBreakdown f = persistent(m, full);
  const est::MemoryBreakdown l = persistent(m, s);
  // Under autocast the adapters are fp32 (PEFT upcasts them): fp32 gradients and states.
  EXPECT_EQ(l.gradients, 4 * 16777216);
  EXPECT_EQ(l.optimizer_states, 8 * 16777216);
  EXPECT_LT(l.gradients * 100, f.gradients);
  EXPECT_LT(l.optimizer_states * 100, f.optimizer_states);
  EXPECT_EQ(l.weights, 2 * 6738415616 + 4 * 16777216 + 64 * 4);  // bf16 base + fp32 adapters + inv_freq
  // Against a pure-bf16 full fine-tune, as measured with PEFT (FINDINGS.md "LoRA (PEFT)"; the earlier
  // "+ 4 targets x N x rank x 2 per layer" counted frozen linears as saving inputs): per layer the frozen
  // norms drop their 16-bit normed outputs (-2 x 2·N·h·2), the frozen MLP its product (-N·i·2), and under
  // autocast each of the 4 adapters keeps x·A (N·16·2) and its own 16-bit input (N·h·2): N·(128 - 2i).
  // The first block's input needs no grad: its input norm (N·h·4 + N·4) and q, k, v's cast A (2·16·h each).
  est::TrainingSetup pure = full;
  pure.precision = est::Precision::Bf16Pure;
  EXPECT_EQ(est::forward_saved(m, s, est::cuda_device()).layers - est::forward_saved(m, pure, est::cuda_device()).layers,
            int64_t{32} * 1024 * (128 - 2 * 11008) - (int64_t{1024} * 4096 * 4 + 1024 * 4) - 3 * 2 * 16 * 4096);

  // QLoRA: NF4 base weights are a little over a quarter of bf16 (embeddings and head stay 16-bit).
  s.lora.base = est::BaseWeightDtype::Nf4;
  const int64_t nf4 = persistent(m, s).weights;
  s.lora.base = est::BaseWeightDtype::Int8;
  const int64_t int8 = persistent(m, s).weights;
  EXPECT_LT(nf4, int8);
  EXPECT_LT(int8, l.weights);
  EXPECT_GT(nf4, l.weights / 4);
  EXPECT_LT(nf4, l.weights * 3 / 10);
}

// ---------------------------------------------------------------- activations

TEST(Activations, CheckpointingReducesActivations) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  est::TrainingSetup s = full_bf16_mixed();
  s.micro_batch = 4;
  auto act = [&](const char* policy) {
    est::parse_checkpointing(policy, s);
    return est::forward_saved(m, s, est::cuda_device()).total();
  };
  const int64_t none = act("none"), every4 = act("every:4"), every2 = act("every:2"), full = act("full");
  EXPECT_LT(full, every2);
  EXPECT_LT(every2, every4);
  EXPECT_LT(every4, none);
  EXPECT_EQ(act("every:1"), full);
  EXPECT_LT(full * 5, none);  // layer inputs only: far smaller
}

TEST(Activations, FlashKeepsNoScoreMatrix) {
  const est::ModelSpec m = est::preset("mistral-7b");
  est::TrainingSetup s = full_bf16_mixed();
  s.seq_len = 4096;
  s.attention = est::AttentionKind::Eager;
  const est::MemoryBreakdown eager = est::estimate_memory(m, s, est::cuda_device());
  s.attention = est::AttentionKind::Flash;
  const est::MemoryBreakdown flash = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_LT(flash.activations, eager.activations);
  EXPECT_LT(flash.total(), eager.total());
  // The eager difference grows with s²: at least the 2-byte softmax output per head and layer.
  EXPECT_GT(eager.activations - flash.activations, int64_t{32} * 32 * 4096 * 4096 * 2 / 2);
}

TEST(Activations, MonotoneInBatchAndSequence) {
  for (const char* name : {"gpt2", "llama-3-8b", "bert-base"}) {
    const est::ModelSpec m = est::preset(name);
    est::TrainingSetup s = full_bf16_mixed();
    s.seq_len = 512;
    // Activations grow strictly; the allocated peak never falls, but stays flat while the optimizer step's
    // temporaries (which do not depend on the batch) are the larger transient peak. (The allocator's
    // rounding and reserve, as the real allocator's, need not grow with the batch: the figures may dip.)
    est::MemoryBreakdown previous;
    for (int64_t b = 1; b <= 64; b *= 2) {
      s.micro_batch = b;
      const est::MemoryBreakdown now = est::estimate_memory(m, s, est::cuda_device());
      if (b > 1) {
        EXPECT_GT(now.activations, previous.activations) << name << " b=" << b;
        EXPECT_GE(now.allocated_peak() - now.block_rounding, previous.allocated_peak() - previous.block_rounding)
            << name << " b=" << b;
      }
      previous = now;
    }
    s.micro_batch = 1;
    const int64_t at_1 = est::estimate_memory(m, s, est::cuda_device()).total();
    EXPECT_GT(previous.total(), at_1) << name;
    s.seq_len = 256;
    EXPECT_LT(est::estimate_memory(m, s, est::cuda_device()).activations,
              est::estimate_memory(m, [&] { auto t = s; t.seq_len = 512; return t; }(), est::cuda_device()).activations);
  }
}

TEST(Activations, ParamsOnlyHasNoActivationModel) {
  const est::ModelSpec m = est::params_only_model(est::parse_param_count("7B"));
  est::TrainingSetup s = full_bf16_mixed();
  const est::MemoryBreakdown b = est::estimate_memory(m, s, est::cpu_device());
  EXPECT_EQ(b.activations, 0);
  EXPECT_EQ(b.logits, 0);
  EXPECT_EQ(b.weights + b.gradients + b.master_weights + b.optimizer_states, int64_t{16} * 7000000000);
}

TEST(Estimate, CudaProfileAddsContextWorkspacesAndTheAllocatorsReserve) {
  const est::ModelSpec m = est::preset("gpt2");
  const est::TrainingSetup s = full_bf16_mixed();
  const est::MemoryBreakdown cpu = est::estimate_memory(m, s, est::cpu_device());
  const est::MemoryBreakdown cuda = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_EQ(cpu.cuda_context + cpu.allocator_slack + cpu.workspaces + cpu.nccl_buffers, 0);
  EXPECT_EQ(cpu.total(), cpu.allocated_peak());
  EXPECT_EQ(cpu.band_below + cpu.band_above, 0);
  // An H100 with torch 2.11 (CUDA 13): the H200 run's measured context and workspaces (65 MiB: two handles'
  // 32 MiB cuBLAS workspaces and one 1 MiB cuBLASLt workspace).
  EXPECT_EQ(cuda.cuda_context, 809041920);
  EXPECT_EQ(cuda.workspaces, int64_t{65} << 20);
  EXPECT_EQ(cuda.nccl_buffers, 0);  // one GPU
  EXPECT_GT(cuda.allocator_slack, 0);
  // The three figures: allocated <= reserved <= device used, each the sum of its parts.
  int64_t sum = 0;
  for (const auto& item : cuda.items()) sum += item.second;
  EXPECT_EQ(sum, cuda.total());
  EXPECT_EQ(cuda.reserved_peak(), cuda.allocated_peak() + cuda.allocator_slack);
  EXPECT_EQ(cuda.total(), cuda.reserved_peak() + cuda.cuda_context);
  EXPECT_EQ(cuda.items().size(), 12u);
  // The blocks' rounding is allocated (max_memory_allocated counts whole blocks), below the reserve.
  EXPECT_GE(cuda.block_rounding, 0);
  EXPECT_LT(cuda.block_rounding, cuda.allocator_slack + (int64_t{64} << 20));
  // The band: 10% of the allocated bytes below and 25% above, half the reserve, and the context's range (down to
  // the table's 300 MiB for drivers not measured, up to the measured 813,236,224 bytes).
  const auto share = [&](double f) { return std::llround(f * static_cast<double>(cuda.allocated_peak())); };
  const int64_t half_reserve = cuda.allocator_slack / 2;
  EXPECT_EQ(cuda.band_below, half_reserve + (809041920 - (int64_t{300} << 20)) + share(0.10));
  EXPECT_EQ(cuda.band_above, half_reserve + (813236224 - 809041920) + share(0.25));
}

// ---------------------------------------------------------------- the peak of a step

// Peaks of real CPU training steps (two steps of Hugging Face models under gpuops.memory_budget,
// bench/estimator_validation/validate.py, torch 2.11.0, transformers 4.57.3), in bytes.
TEST(StepPeak, MatchesMeasuredCpuSteps) {
  struct Case {
    const char* config;
    est::Precision precision;
    est::OptimizerKind optimizer;
    const char* checkpointing;
    est::AttentionKind attention;
    int64_t measured;
  };
  const char* llama_gqa = R"({"model_type": "llama", "vocab_size": 4000, "hidden_size": 128,
      "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 344,
      "max_position_embeddings": 256, "tie_word_embeddings": false})";
  const char* llama_tied = R"({"model_type": "llama", "vocab_size": 6000, "hidden_size": 192,
      "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 512,
      "max_position_embeddings": 256, "tie_word_embeddings": true})";
  const char* gpt2_dropout = R"({"model_type": "gpt2", "vocab_size": 3000, "n_embd": 96, "n_layer": 3,
      "n_head": 4, "n_positions": 256, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1})";
  const Case cases[] = {
      {llama_gqa, est::Precision::Fp32, est::OptimizerKind::SgdMomentum, "none", est::AttentionKind::Eager,
       60359744},
      {llama_tied, est::Precision::Bf16Pure, est::OptimizerKind::SgdMomentum, "none", est::AttentionKind::Sdpa,
       55031656},
      {gpt2_dropout, est::Precision::Bf16Mixed, est::OptimizerKind::AdamW, "full", est::AttentionKind::Eager,
       28352116},
  };
  for (const Case& c : cases) {
    const est::ModelSpec m = est::model_from_hf_config(c.config, "case");
    est::TrainingSetup s;
    s.precision = c.precision;
    s.optimizer = c.optimizer;
    est::parse_checkpointing(c.checkpointing, s);
    s.attention = c.attention;
    s.micro_batch = 4;
    s.seq_len = 128;
    const est::MemoryBreakdown b = est::estimate_memory(m, s, est::cpu_device());
    EXPECT_NEAR(static_cast<double>(b.total()), static_cast<double>(c.measured), 1e-4 * c.measured)
        << c.config;
    EXPECT_EQ(b.peak_phase, est::StepPhase::LossBackward);
  }
}

TEST(StepPeak, PeakIsTheLargestPhaseAndItsBreakdown) {
  const est::ModelSpec m = est::preset("llama-2-7b");
  est::TrainingSetup s = full_bf16_mixed();
  s.seq_len = 128;
  const auto phases = est::phase_breakdowns(m, s, est::cuda_device(), persistent(m, s));
  ASSERT_EQ(phases.size(), 4u);
  int64_t largest = 0;
  for (const auto& p : phases) largest = std::max(largest, p.total());
  const est::MemoryBreakdown peak = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_EQ(peak.allocated_peak() - peak.workspaces - peak.block_rounding, largest);
  // Gradients are None during the loss backward of a step, alive from the end of the backward on.
  EXPECT_EQ(phases[0].gradients, 0);
  EXPECT_EQ(phases[3].gradients, persistent(m, s).gradients);
  // A 7B full fine-tune at a short sequence peaks in the foreach AdamW step: one fp32 list of all params.
  EXPECT_EQ(peak.peak_phase, est::StepPhase::OptimizerStep);
  EXPECT_EQ(peak.temporaries, 4 * est::parameter_count(m));
  // Fused AdamW has no such list; the peak moves to the backward and drops.
  s.optimizer_impl = est::OptimizerImpl::Fused;
  const est::MemoryBreakdown fused = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_LT(fused.total(), peak.total());
  EXPECT_NE(fused.peak_phase, est::StepPhase::OptimizerStep);
  // Gradient accumulation keeps the gradients alive through the next micro-batch's backward.
  s.grad_accum = 4;
  const auto accum = est::phase_breakdowns(m, s, est::cuda_device(), persistent(m, s));
  EXPECT_EQ(accum[0].gradients, persistent(m, s).gradients);
  EXPECT_GT(est::estimate_memory(m, s, est::cuda_device()).total(), fused.total());
}

TEST(StepPeak, LongSequencesPeakAtTheLoss) {
  // Small model, big vocabulary, long sequence: the fp32 logit gradients dominate.
  const est::ModelSpec m = est::preset("gpt2");
  est::TrainingSetup s = full_bf16_mixed();
  s.micro_batch = 8;
  const est::MemoryBreakdown b = est::estimate_memory(m, s, est::cuda_device());
  EXPECT_EQ(b.peak_phase, est::StepPhase::LossBackward);
  EXPECT_GE(b.logits, int64_t{3} * 8 * 1024 * 50257 * 4);  // saved log-softmax + two fp32 gradients
}

TEST(Attention, SdpaIsFlashOnCudaAndMasksOnTheCpu) {
  const est::ModelSpec m = est::preset("llama-3-8b");
  est::TrainingSetup s = full_bf16_mixed();
  s.seq_len = 2048;
  auto saved = [&](est::AttentionKind a, const est::DeviceProfile& d) {
    s.attention = a;
    return est::forward_saved(m, s, d).total();
  };
  EXPECT_EQ(saved(est::AttentionKind::Sdpa, est::cuda_device()), saved(est::AttentionKind::Flash, est::cuda_device()));
  // The CPU's flash kernel is given a materialised b x s x s mask, saved by every layer.
  EXPECT_EQ(saved(est::AttentionKind::Sdpa, est::cpu_device()) - saved(est::AttentionKind::Flash, est::cpu_device()),
            int64_t{32} * 2048 * 2048 * 2);
}

// ---------------------------------------------------------------- GPU catalog

TEST(GpuCatalog, FindIgnoresCaseAndPunctuation) {
  EXPECT_EQ(est::find_gpu("h100-80gb").name, "H100-80GB");
  EXPECT_EQ(est::find_gpu("A100 80GB").name, "A100-80GB");
  EXPECT_EQ(est::find_gpu("rtx_4090").name, "RTX-4090");
  const std::string msg = error_of([] { est::find_gpu("Z100"); });
  EXPECT_NE(msg.find("'Z100'"), std::string::npos);
  EXPECT_NE(msg.find("H200"), std::string::npos);
  EXPECT_GE(est::gpu_catalog().size(), 9u);
}

TEST(GpuCatalog, MaxMicroBatchFitsAndOneMoreDoesNot) {
  const est::ModelSpec m = est::preset("gpt2-medium");
  est::TrainingSetup s = full_bf16_mixed();
  for (const auto& f : est::fit_catalog(m, s)) {
    const int64_t b = f.max_micro_batch;
    ASSERT_GT(b, 0) << f.gpu->name;
    ASSERT_LT(b, est::kMaxMicroBatch) << f.gpu->name;
    est::TrainingSetup at = s;
    at.micro_batch = b;
    // The verdict is on the top of the band, with the GPU's own profile.
    const est::DeviceProfile device = est::device_of(*f.gpu);
    EXPECT_LE(est::estimate_memory(m, at, device).total_high(), f.gpu->memory_bytes) << f.gpu->name;
    at.micro_batch = b + 1;
    EXPECT_GT(est::estimate_memory(m, at, device).total_high(), f.gpu->memory_bytes) << f.gpu->name;
    EXPECT_EQ(f.fits, f.at_requested.total_high() <= f.gpu->memory_bytes);
  }
}

TEST(GpuCatalog, TooBigForEveryGpuGivesZero) {
  est::TrainingSetup s = full_bf16_mixed();
  for (const auto& f : est::fit_catalog(est::preset("llama-2-70b"), s)) {
    EXPECT_FALSE(f.fits) << f.gpu->name;
    EXPECT_EQ(f.max_micro_batch, 0) << f.gpu->name;
  }
  EXPECT_TRUE(est::recommend(est::preset("llama-2-70b"), s).empty());
}

TEST(GpuCatalog, RecommendCheapestFirstAmongThoseThatFit) {
  est::TrainingSetup s = full_bf16_mixed();
  s.lora.rank = 16;
  s.lora.targets = {"q", "k", "v", "o"};
  s.lora.base = est::BaseWeightDtype::Nf4;
  s.checkpoint = est::CheckpointKind::Full;
  const auto all = est::fit_catalog(est::preset("llama-2-7b"), s);
  const auto rec = est::recommend(est::preset("llama-2-7b"), s);
  size_t fitting = 0;
  for (const auto& f : all) fitting += f.fits && f.precision_ok;
  ASSERT_EQ(rec.size(), fitting);
  ASSERT_GE(rec.size(), 5u);  // QLoRA of a 7B model at seq 1024 fits the 16 and 24 GB cards
  for (size_t i = 0; i < rec.size(); ++i) {
    EXPECT_TRUE(rec[i].fits);
    if (i > 0) {
      EXPECT_LE(rec[i - 1].gpu->spot_price_usd_per_hour, rec[i].gpu->spot_price_usd_per_hour);
    }
  }
  // The cheapest that fits and has bf16: never the T4 (sm_75), which has none.
  const est::GpuFit* cheapest = nullptr;
  for (const auto& f : all)
    if (f.fits && f.precision_ok && (!cheapest || f.gpu->spot_price_usd_per_hour < cheapest->gpu->spot_price_usd_per_hour))
      cheapest = &f;
  ASSERT_NE(cheapest, nullptr);
  EXPECT_EQ(rec.front().gpu->name, cheapest->gpu->name);
  EXPECT_NE(rec.front().gpu->name, "T4");
  s.precision = est::Precision::Fp16Mixed;
  EXPECT_EQ(est::recommend(est::preset("llama-2-7b"), s).front().gpu->name, "T4");
}

TEST(StepPeak, GradientsKeptBetweenStepsAreAliveInTheForward) {
  // zero_grad(set_to_none=False) (torch < 2.0's default) keeps every gradient through the next forward,
  // as accumulation does: the loss moment then holds them all.
  const est::ModelSpec m = est::preset("gpt2");
  est::TrainingSetup s = full_bf16_mixed();
  s.seq_len = 512;
  const auto freed = est::phase_breakdowns(m, s, est::cpu_device(), persistent(m, s));
  s.grads_set_to_none = false;
  const auto kept = est::phase_breakdowns(m, s, est::cpu_device(), persistent(m, s));
  EXPECT_EQ(freed[0].gradients, 0);
  EXPECT_EQ(kept[0].gradients, 4 * est::parameter_count(m));  // fp32 gradients under autocast
  EXPECT_EQ(kept[0].activations, freed[0].activations);
  EXPECT_EQ(est::parse_zero_grad("zeros"), false);
  EXPECT_EQ(est::parse_zero_grad("none"), true);
  EXPECT_THROW(est::parse_zero_grad("false"), gpuops::ArgumentError);
}

TEST(StepPeak, ZeroReducedAtTheStepKeepsTheWholeFlatGradient) {
  // gpuops' ZeroOptimizer (zero_reduce "step"): stage 1 keeps every gradient from zero_grad() on, stage 2 adds
  // its fp32 shard; reduced in buckets during backward (DeepSpeed), stage 2 holds 1/N.
  const est::ModelSpec m = est::preset("gpt2");
  est::TrainingSetup s = full_bf16_mixed();
  s.precision = est::Precision::Fp32;
  s.num_gpus = 4;
  const int64_t n = est::parameter_count(m);
  s.zero_stage = 2;
  EXPECT_EQ(persistent(m, s).gradients, 4 * ((n + 3) / 4));  // DeepSpeed: a quarter
  s.zero_reduce_at_step = true;
  EXPECT_EQ(persistent(m, s).gradients, 4 * n + 4 * ((n + 3) / 4));
  EXPECT_EQ(est::phase_breakdowns(m, s, est::cpu_device(), persistent(m, s))[0].gradients, persistent(m, s).gradients);
  s.zero_stage = 1;
  EXPECT_EQ(persistent(m, s).gradients, 4 * n);
  s.zero_stage = 3;
  EXPECT_THROW(est::validate(s, m), gpuops::ArgumentError);
  EXPECT_EQ(est::parse_zero_reduce("step"), true);
  EXPECT_EQ(est::parse_zero_reduce("backward"), false);
  EXPECT_THROW(est::parse_zero_reduce("hooks"), gpuops::ArgumentError);
}

TEST(StepPeak, ZeroReducedInTheBackwardCountsTheBucketsInFlight) {
  // gpuops' ZeroOptimizer(reduce_in_backward, bucket_bytes 4 MiB) on gpt2, fp32, stage 2, 4 GPUs. Tensors:
  // wte 50257 x 768 = 38,597,376 (tied: no separate head), wpe 786,432, the largest block tensor c_fc
  // 2,359,296; a bucket holds 1,048,576 values unless one tensor is larger.
  const est::ModelSpec m = est::preset("gpt2");
  est::TrainingSetup s = full_bf16_mixed();
  s.precision = est::Precision::Fp32;
  s.optimizer_impl = est::OptimizerImpl::Fused;
  s.num_gpus = 4;
  s.zero_stage = 2;
  const int64_t n = est::parameter_count(m);
  const auto cuda = est::cuda_device();
  const auto deepspeed = est::phase_breakdowns(m, s, cuda, persistent(m, s));
  s.zero_bucket_bytes = 4 << 20;
  EXPECT_EQ(persistent(m, s).gradients, 4 * ((n + 3) / 4));  // the fp32 shard, from construction on
  const auto ours = est::phase_breakdowns(m, s, cuda, persistent(m, s));
  const auto at = [](const std::vector<est::MemoryBreakdown>& p, est::StepPhase phase) {
    return p[static_cast<int>(phase)];
  };
  // Last block's backward: the first bucket (no untied head: 1,048,576 values) and two of c_fc's size alive,
  // 5,767,168 values in fp32; launched, the two after the first: 3,407,872 values, their fp32 shards a quarter.
  EXPECT_EQ(at(ours, est::StepPhase::AttentionBackward).temporaries -
                at(deepspeed, est::StepPhase::AttentionBackward).temporaries,
            5767168 * 4 + 3407872);
  // End of the backward: wte's bucket and two of c_fc's (43,315,968 values) alive and launched (their shards),
  // and wte's own gradient before its copy is freed; more than the tied sum's 2 x wte.
  const int64_t end = 43315968 * 4 + 43315968 + 38597376 * 4;
  EXPECT_EQ(at(ours, est::StepPhase::BackwardEnd).temporaries, end);
  // On the CPU (Gloo), each launched bucket also has Gloo's clone, and the all-gathers after the step a flat
  // copy of every bucket.
  const auto cpu = est::phase_breakdowns(m, s, est::cpu_device(), persistent(m, s));
  EXPECT_EQ(at(cpu, est::StepPhase::BackwardEnd).temporaries, end + 43315968 * 4);
  EXPECT_EQ(at(cpu, est::StepPhase::OptimizerStep).temporaries, 4 * n);
  EXPECT_EQ(at(ours, est::StepPhase::OptimizerStep).temporaries, 0);  // NCCL gathers in place
  // Stage 1 keeps the flat gradient (persistent) and its fp32 shard; in flight only the reduced shards.
  s.zero_stage = 1;
  EXPECT_EQ(persistent(m, s).gradients, 4 * n + 4 * ((n + 3) / 4));
  // Bad input: negative, or with a layout gpuops' ZeroOptimizer does not have.
  for (auto bad : std::vector<std::function<void(est::TrainingSetup&)>>{
           [](est::TrainingSetup& t) { t.zero_bucket_bytes = -1; },
           [](est::TrainingSetup& t) { t.zero_stage = 3; },
           [](est::TrainingSetup& t) { t.zero_stage = 0; },
           [](est::TrainingSetup& t) { t.zero_reduce_at_step = true; }}) {
    est::TrainingSetup t = s;
    bad(t);
    try {
      est::validate(t, m);
      ADD_FAILURE() << "accepted";
    } catch (const gpuops::ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("zero-bucket-bytes"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(est::validate(s, est::params_only_model(7000000000)), gpuops::ArgumentError);
  // A bucket larger than the model is the model: no overflow, the same as one bucket of exactly its size.
  s.zero_stage = 2;
  s.precision = est::Precision::Bf16Pure;
  s.zero_bucket_bytes = std::numeric_limits<int64_t>::max();
  const auto huge = est::phase_breakdowns(m, s, cuda, persistent(m, s));
  s.zero_bucket_bytes = 2 * n;
  const auto whole = est::phase_breakdowns(m, s, cuda, persistent(m, s));
  for (size_t p = 0; p < huge.size(); ++p) EXPECT_EQ(huge[p].total(), whole[p].total()) << p;
}
