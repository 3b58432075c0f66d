// The `gpuops` command line, run in-process through gpuops::run_cli.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuops/cli.h"
#include "gpuops/estimator.h"
#include "cli_runner.h"

namespace est = gpuops::estimator;
using nlohmann::json;

namespace {

using Result = gpuops::testing::CliResult;
using gpuops::testing::joined;

Result run(const std::vector<std::string>& args) { return gpuops::testing::run_cli(args); }

}  // namespace

TEST(Cli, DefaultRunsTheTwoEmbeddedSetups) {
  const Result r = run({"estimate"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.err.empty());
  EXPECT_NE(r.out.find("LoRA fine-tune of llama-2-7b (rank 16 on q,k,v,o"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("full fine-tune of llama-2-7b (bf16-mixed"), std::string::npos) << r.out;
  for (const auto& g : est::gpu_catalog()) EXPECT_NE(r.out.find(g.name), std::string::npos) << g.name;
  EXPECT_NE(r.out.find("max micro-batch"), std::string::npos);
  EXPECT_NE(r.out.find("optimizer_states"), std::string::npos);
}

TEST(Cli, DefaultJsonHasBothRunsAndEveryKey) {
  const Result r = run({"estimate", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j.at("runs").size(), 2u);
  const json& lora = j["runs"][0];
  EXPECT_EQ(lora.at("setup").at("lora").at("rank"), 16);
  EXPECT_EQ(j["runs"][1].at("setup").at("lora").at("rank"), 0);
  EXPECT_EQ(lora.at("model").at("parameters"), 6738415616);
  EXPECT_EQ(lora.at("model").at("trainable_parameters"), 16777216);
  int64_t sum = 0;
  for (const char* key : {"weights", "gradients", "master_weights", "optimizer_states", "activations", "logits",
                          "temporaries", "workspaces", "block_rounding", "allocator_slack", "cuda_context",
                          "nccl_buffers"}) {
    ASSERT_TRUE(lora.at("breakdown").contains(key)) << key;
    EXPECT_TRUE(lora["breakdown"][key].is_number_integer()) << key;
    sum += lora["breakdown"][key].get<int64_t>();
  }
  EXPECT_EQ(lora["breakdown"].at("total").get<int64_t>(), sum);
  ASSERT_EQ(lora.at("gpus").size(), est::gpu_catalog().size());
  for (const auto& g : lora["gpus"])
    for (const char* key : {"name", "memory_bytes", "fits", "precision_supported", "total_bytes", "total_high_bytes",
                            "headroom_bytes", "max_micro_batch", "spot_price_usd_per_hour"})
      EXPECT_TRUE(g.contains(key)) << key;
}

TEST(Cli, JsonMatchesTheLibrary) {
  const Result r = run({"estimate", "--model", "gpt2", "--precision", "fp32", "--batch", "4", "--seq", "256",
                        "--checkpointing", "every:3", "--attention", "eager", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  est::TrainingSetup s;
  s.precision = est::Precision::Fp32;
  s.micro_batch = 4;
  s.seq_len = 256;
  s.checkpoint = est::CheckpointKind::EveryK;
  s.checkpoint_every_k = 3;
  s.attention = est::AttentionKind::Eager;
  const int64_t expected = est::estimate_memory(est::preset("gpt2"), s, est::cuda_device()).total();
  EXPECT_EQ(json::parse(r.out)["runs"][0]["breakdown"]["total"].get<int64_t>(), expected);
}

TEST(Cli, AmpLayoutOptimizerImplAndPeakPhaseReachTheJson) {
  const Result r = run({"estimate", "--model", "llama-2-7b", "--seq", "256", "--amp", "master-copy",
                        "--optimizer-impl", "fused", "--device", "cpu", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json run0 = json::parse(r.out)["runs"][0];
  EXPECT_EQ(run0["setup"]["amp"], "master-copy");
  EXPECT_EQ(run0["setup"]["optimizer_impl"], "fused");
  est::TrainingSetup s;
  s.amp = est::AmpLayout::MasterCopy;
  s.optimizer_impl = est::OptimizerImpl::Fused;
  s.seq_len = 256;
  const est::MemoryBreakdown b = est::estimate_memory(est::preset("llama-2-7b"), s, est::cpu_device());
  EXPECT_EQ(run0["breakdown"]["total"].get<int64_t>(), b.total());
  EXPECT_EQ(run0["breakdown"]["master_weights"].get<int64_t>(), 4 * int64_t{6738415616});
  EXPECT_EQ(run0["breakdown"]["peak_phase"], std::string(est::to_string(b.peak_phase)));
  EXPECT_NE(run({"estimate", "--model", "gpt2"}).out.find("max_memory_allocated, peak at "), std::string::npos);
}

TEST(Cli, ShortContextModelsDefaultToTheirMaximumSequence) {
  const Result r = run({"estimate", "--model", "bert-base", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["runs"][0]["setup"]["seq_len"], 512);
}

TEST(Cli, RecommendListsOnlyFittingGpusCheapestFirst) {
  const Result r = run({"estimate", "--model", "llama-2-7b", "--lora-rank", "16", "--lora-targets", "q,k,v,o",
                        "--base-dtype", "nf4", "--checkpointing", "full", "--seq", "1024", "--recommend", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json gpus = json::parse(r.out)["runs"][0]["gpus"];
  ASSERT_FALSE(gpus.empty());
  double previous = 0;
  for (const auto& g : gpus) {
    EXPECT_TRUE(g["fits"].get<bool>());
    EXPECT_GE(g["spot_price_usd_per_hour"].get<double>(), previous);
    previous = g["spot_price_usd_per_hour"].get<double>();
  }
}

TEST(Cli, OneGpuConfigAndParams) {
  Result r = run({"estimate", "--model", "mistral-7b", "--gpu", "h100 80gb", "--zero", "3", "--gpus", "8"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("H100-80GB"), std::string::npos);
  EXPECT_EQ(r.out.find("A100-40GB"), std::string::npos);

  const std::string path = ::testing::TempDir() + "cli_config.json";
  std::ofstream(path) << R"({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
                             "n_head": 12, "n_positions": 1024})";
  r = run({"estimate", "--config", path, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["runs"][0]["model"]["parameters"], 124439808);

  r = run({"estimate", "--params", "7B", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json run0 = json::parse(r.out)["runs"][0];
  EXPECT_EQ(run0["model"]["parameters"], 7000000000);
  EXPECT_TRUE(run0["gpus"][0]["max_micro_batch"].is_null());
  EXPECT_FALSE(run0["notes"].empty());
}

TEST(Cli, GpusAndPresets) {
  Result r = run({"gpus", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["gpus"].size(), est::gpu_catalog().size());
  r = run({"gpus"});
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("H200"), std::string::npos);
  r = run({"presets"});
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("6738415616"), std::string::npos);
  r = run({"presets", "--json"});
  ASSERT_EQ(r.code, 0);
  EXPECT_EQ(json::parse(r.out)["presets"].size(), est::preset_names().size());
}

TEST(Cli, HelpReturnsZero) {
  for (const auto& args : std::vector<std::vector<std::string>>{{"--help"}, {"estimate", "--help"}, {"gpus", "-h"}}) {
    const Result r = run(args);
    EXPECT_EQ(r.code, 0) << joined(args);
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << joined(args) << r.out;
  }
  EXPECT_NE(run({"estimate", "--help"}).out.find("--lora-rank"), std::string::npos);
}

TEST(Cli, BadInputIsOneLineNamingTheArgumentAndExitsTwo) {
  const std::string missing = ::testing::TempDir() + "missing_config.json";
  const std::string bad_json = ::testing::TempDir() + "bad_cli_config.json";
  std::ofstream(bad_json) << "{not json";
  // (arguments, text the message must contain)
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"estimate", "--model", "gpt5"}, "gpt5"},
      {{"estimate", "--config", missing}, missing},
      {{"estimate", "--config", bad_json}, bad_json},
      {{"estimate", "--params", "7X"}, "params"},
      {{"estimate", "--params", "0"}, "params"},
      {{"estimate", "--model", "gpt2", "--batch", "0"}, "batch"},
      {{"estimate", "--model", "gpt2", "--batch=-3"}, "batch"},
      {{"estimate", "--model", "gpt2", "--batch", "abc"}, "--batch"},
      {{"estimate", "--model", "gpt2", "--seq", "0"}, "seq"},
      {{"estimate", "--model", "gpt2", "--seq", "4096"}, "seq"},
      {{"estimate", "--model", "gpt2", "--grad-accum", "0"}, "grad-accum"},
      {{"estimate", "--model", "gpt2", "--lora-rank", "99999"}, "lora-rank"},
      {{"estimate", "--model", "gpt2", "--lora-rank", "-1"}, "lora-rank"},
      {{"estimate", "--model", "gpt2", "--lora-rank", "8", "--lora-targets", "q,zz"}, "lora-targets"},
      {{"estimate", "--model", "gpt2", "--zero", "4"}, "zero"},
      {{"estimate", "--model", "gpt2", "--gpus", "0"}, "gpus"},
      {{"estimate", "--model", "gpt2", "--precision", "fp8"}, "precision"},
      {{"estimate", "--model", "gpt2", "--optimizer", "lion"}, "optimizer"},
      {{"estimate", "--model", "gpt2", "--checkpointing", "every:0"}, "checkpointing"},
      {{"estimate", "--model", "gpt2", "--attention", "sparse"}, "attention"},
      {{"estimate", "--model", "gpt2", "--amp", "apex"}, "amp"},
      {{"estimate", "--model", "gpt2", "--precision", "bf16", "--amp", "master-copy"}, "amp"},
      {{"estimate", "--model", "gpt2", "--optimizer-impl", "turbo"}, "optimizer-impl"},
      {{"estimate", "--model", "gpt2", "--base-dtype", "nf4"}, "base-dtype"},
      {{"estimate", "--model", "gpt2", "--base-dtype", "fp4", "--lora-rank", "8"}, "base-dtype"},
      {{"estimate", "--model", "gpt2", "--device", "tpu"}, "device"},
      {{"estimate", "--model", "gpt2", "--gpu", "Z100"}, "Z100"},
      {{"estimate", "--params", "7B", "--lora-rank", "8"}, "lora-rank"},
      {{"estimate", "--model", "gpt2", "--config", "x.json"}, "--config"},
      {{"estimate", "--frobnicate"}, "--frobnicate"},
      {{"estimate", "--model"}, "--model"},
      {{"launch"}, "launch"},
      {{}, "command"},
      {{"--json"}, "--json"},
  };
  for (const auto& [args, needle] : cases) {
    const Result r = run(args);
    EXPECT_EQ(r.code, 2) << joined(args);
    EXPECT_TRUE(r.out.empty()) << joined(args) << "\nstdout: " << r.out;
    EXPECT_EQ(r.err.rfind("gpuops: error: ", 0), 0u) << joined(args) << "\nstderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << joined(args) << "\nstderr: " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << joined(args) << "\nstderr: " << r.err;
  }
}
