// Hostile input to the estimator's C++ API and the command line (issue 10, defects 1, 2, 9, 15): sizes
// whose bytes overflow int64, out-of-range enums, strange numbers, config files of the wrong kind or
// content, undecodable bytes, an output that cannot be written. Every case must end in a clear
// ArgumentError / one error line, never a wrapped number, a hang or a crash.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <streambuf>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuops/cli.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "cli_runner.h"

namespace est = gpuops::estimator;
using nlohmann::json;

namespace {

using Result = gpuops::testing::CliResult;
using gpuops::testing::joined;

Result run(const std::vector<std::string>& args) { return gpuops::testing::run_cli(args); }

// The message of the ArgumentError `f` throws ("" and a test failure if it throws nothing).
template <typename F>
std::string argument_error(F f) {
  try {
    f();
  } catch (const gpuops::ArgumentError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ArgumentError";
  return "";
}

// The largest accepted value an overflow message reports ("accepted: 1 to N").
int64_t accepted_max(const std::string& message) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(message, m, std::regex("accepted: 1 to ([0-9]+)"))) << message;
  return m.empty() ? 0 : std::stoll(m[1]);
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

void expect_one_error_line(const Result& r, const std::vector<std::string>& args, const std::string& needle,
                           int code = 2) {
  EXPECT_EQ(r.code, code) << joined(args) << "\nstderr: " << r.err;
  EXPECT_TRUE(r.out.empty()) << joined(args) << "\nstdout: " << r.out;
  EXPECT_EQ(r.err.rfind("gpuops: error: ", 0), 0u) << joined(args) << "\nstderr: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << joined(args) << "\nstderr: " << r.err;
  EXPECT_EQ(est::printable(r.err.substr(0, r.err.size() - 1)) + "\n", r.err) << "not printable UTF-8: " << joined(args);
  EXPECT_NE(r.err.find(needle), std::string::npos) << joined(args) << "\nstderr: " << r.err;
}

est::TrainingSetup setup_with(int64_t batch, int64_t seq, est::AttentionKind attention = est::AttentionKind::Sdpa) {
  est::TrainingSetup s;
  s.micro_batch = batch;
  s.seq_len = seq;
  s.attention = attention;
  return s;
}

}  // namespace

// ---- defect 1: checked size arithmetic -------------------------------------------------------------

TEST(EstimatorOverflow, ReportedCasesAreRefusedNamingTheArgument) {
  const est::ModelSpec llama = est::preset("llama-2-7b");
  const auto cuda = est::cuda_device();
  std::string msg = argument_error(
      [&] { est::estimate_memory(llama, setup_with(1, 3000000000, est::AttentionKind::Eager), cuda); });
  EXPECT_NE(msg.find("seq"), std::string::npos) << msg;
  msg = argument_error([&] { est::estimate_memory(llama, setup_with(int64_t{1} << 62, 2048), cuda); });
  EXPECT_NE(msg.find("batch"), std::string::npos) << msg;
  msg = argument_error([&] {
    est::estimate_memory(est::params_only_model(est::parse_param_count("8e18"), "8e18"), est::TrainingSetup{}, cuda);
  });
  EXPECT_NE(msg.find("params '8e18'"), std::string::npos) << msg;
}

TEST(EstimatorOverflow, TheReportedLimitIsTheExactBoundary) {
  // The accepted maximum of each message estimates without error, and one more overflows: the limit is
  // derived from the checked arithmetic itself.
  const auto cuda = est::cuda_device();
  std::mt19937_64 rng(std::random_device{}());
  for (const char* name : {"llama-2-7b", "gpt2", "bert-base", "mistral-7b"}) {
    const est::ModelSpec m = est::preset(name);
    const bool learned = m.learned_positions;
    const int64_t seq = learned ? m.max_positions : int64_t{1} << (46 + rng() % 16);
    const auto attention = rng() % 2 ? est::AttentionKind::Eager : est::AttentionKind::Flash;
    est::TrainingSetup s = setup_with(learned ? int64_t{1} << 60 : 1, seq, attention);
    const std::string msg = argument_error([&] { est::estimate_memory(m, s, cuda); });
    const int64_t max = accepted_max(msg);
    int64_t& field = learned ? s.micro_batch : s.seq_len;
    SCOPED_TRACE(msg);
    field = max;
    const est::MemoryBreakdown ok = est::estimate_memory(m, s, cuda);
    EXPECT_GT(ok.total(), 0);
    for (const auto& [item, bytes] : ok.items()) EXPECT_GE(bytes, 0) << item;
    field = max + 1;
    EXPECT_THROW(est::estimate_memory(m, s, cuda), gpuops::ArgumentError);
  }
}

TEST(EstimatorOverflow, RandomSizesEitherEstimateExactlyOrAreRefused) {
  // Log-uniform sizes up to 2^62: an accepted estimate has no negative category and a total equal to the
  // 128-bit sum of its items (no wrapped term), and grows with the batch.
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seed = rng();
  rng.seed(seed);
  const auto big = [&] { return std::max<int64_t>(1, static_cast<int64_t>(rng() >> (1 + rng() % 63))); };
  const auto names = est::preset_names();
  int refused = 0, accepted = 0;
  for (int i = 0; i < 300; ++i) {
    const est::ModelSpec m = est::preset(names[rng() % names.size()]);
    est::TrainingSetup s = setup_with(big(), m.learned_positions ? 1 + rng() % m.max_positions : big(),
                                      static_cast<est::AttentionKind>(rng() % 3));
    s.precision = static_cast<est::Precision>(rng() % 4);
    if (rng() % 3 == 0) s.checkpoint = est::CheckpointKind::Full;
    const auto device = rng() % 2 ? est::cuda_device() : est::cpu_device();
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " case " << i << " " << m.name << " batch "
                                      << s.micro_batch << " seq " << s.seq_len);
    try {
      const est::MemoryBreakdown b = est::estimate_memory(m, s, device);
      __int128 sum = 0;
      for (const auto& [item, bytes] : b.items()) {
        EXPECT_GE(bytes, 0) << item;
        sum += bytes;
      }
      EXPECT_EQ(sum, static_cast<__int128>(b.total()));
      if (s.micro_batch > 1) {
        est::TrainingSetup half = s;
        half.micro_batch = s.micro_batch / 2;
        // The tensors never shrink with the batch (the allocator's rounding and reserve may).
        const est::MemoryBreakdown h = est::estimate_memory(m, half, device);
        EXPECT_LE(h.allocated_peak() - h.block_rounding, b.allocated_peak() - b.block_rounding);
      }
      ++accepted;
    } catch (const gpuops::ArgumentError& e) {
      const std::string msg = e.what();
      EXPECT_TRUE(msg.find("overflows 64 bits") != std::string::npos) << msg;
      ++refused;
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

TEST(EstimatorOverflow, ConfigSizesWhoseParameterCountOverflowsAreRefusedAtLoad) {
  // hidden_size 1e9: h x h pooler / q, k, v projections pass 2^63.
  const std::string msg = argument_error([] {
    est::model_from_hf_config(R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 1000000000,
        "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008})", "big.json");
  });
  EXPECT_NE(msg.find("big.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overflows 64 bits"), std::string::npos) << msg;
  // vocab_size 1e15: the count fits in int64, its bytes do not: refused by the estimate, naming the model.
  const est::ModelSpec vocab = est::model_from_hf_config(R"({"model_type": "llama", "vocab_size": 1000000000000000,
      "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008})",
                                                         "vocab.json");
  const std::string msg2 =
      argument_error([&] { est::estimate_memory(vocab, est::TrainingSetup{}, est::cuda_device()); });
  EXPECT_NE(msg2.find("model 'vocab.json'"), std::string::npos) << msg2;
}

TEST(EstimatorOverflow, BatchSearchTreatsAnOverflowingBatchAsNotFitting) {
  // In a memory of 2^63 - 1 bytes batch 1 fits and the search's cap (65536) overflows: the answer lies
  // between, and no error escapes.
  const est::ModelSpec llama = est::preset("llama-2-7b");
  const est::TrainingSetup s = setup_with(1, 1000000, est::AttentionKind::Eager);
  const int64_t max = est::max_micro_batch(llama, s, INT64_MAX);
  EXPECT_GE(max, 1);
  EXPECT_LT(max, est::kMaxMicroBatch);
  for (const auto& f : est::fit_catalog(llama, s)) EXPECT_FALSE(f.fits);
}

TEST(EstimatorOverflow, GlobalBatchOverflowIsRefused) {
  est::TrainingSetup s = setup_with(int64_t{1} << 40, 16);
  s.grad_accum = int64_t{1} << 40;
  const std::string msg = argument_error([&] { est::validate(s, est::preset("gpt2")); });
  EXPECT_NE(msg.find("global batch"), std::string::npos) << msg;
}

// ---- defect 15: enum values out of range -----------------------------------------------------------

TEST(EstimatorEnums, OutOfRangeValuesAreRefusedNamingTheField) {
  const est::ModelSpec gpt2 = est::preset("gpt2");
  const auto check_setup = [&](auto mutate, const char* name) {
    est::TrainingSetup s;
    mutate(s);
    const std::string msg = argument_error([&] { est::estimate_memory(gpt2, s, est::cuda_device()); });
    EXPECT_EQ(msg.rfind(name, 0), 0u) << msg;
  };
  check_setup([](est::TrainingSetup& s) { s.precision = static_cast<est::Precision>(7); }, "precision 7");
  check_setup([](est::TrainingSetup& s) { s.precision = static_cast<est::Precision>(-1); }, "precision -1");
  check_setup([](est::TrainingSetup& s) { s.amp = static_cast<est::AmpLayout>(2); }, "amp");
  check_setup([](est::TrainingSetup& s) { s.optimizer = static_cast<est::OptimizerKind>(99); }, "optimizer");
  check_setup([](est::TrainingSetup& s) { s.optimizer_impl = static_cast<est::OptimizerImpl>(4); }, "optimizer-impl");
  check_setup([](est::TrainingSetup& s) { s.attention = static_cast<est::AttentionKind>(3); }, "attention");
  check_setup([](est::TrainingSetup& s) { s.lora.base = static_cast<est::BaseWeightDtype>(9); }, "base-dtype");
  check_setup([](est::TrainingSetup& s) { s.checkpoint = static_cast<est::CheckpointKind>(9); }, "checkpointing");

  const auto check_model = [&](auto mutate, const char* needle) {
    est::ModelSpec m = gpt2;
    mutate(m);
    const std::string msg = argument_error([&] { est::validate(m); });
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  };
  check_model([](est::ModelSpec& m) { m.family = static_cast<est::ModelFamily>(3); }, "family 3");
  check_model([](est::ModelSpec& m) { m.mlp = static_cast<est::MlpKind>(2); }, "mlp 2");
  check_model([](est::ModelSpec& m) { m.norm = static_cast<est::NormKind>(-4); }, "norm -4");

  est::DeviceProfile d = est::cuda_device();
  d.kind = static_cast<est::DeviceProfile::Kind>(2);
  EXPECT_NE(argument_error([&] { est::estimate_memory(gpt2, {}, d); }).find("device kind"), std::string::npos);
  d = est::cuda_device();
  d.runtime.allocator = static_cast<est::AllocatorMode>(7);
  EXPECT_NE(argument_error([&] { est::estimate_memory(gpt2, {}, d); }).find("allocator mode 7"), std::string::npos);
  d = est::cuda_device();
  d.cuda_context_high = d.cuda_context_bytes - 1;
  EXPECT_NE(argument_error([&] { est::estimate_memory(gpt2, {}, d); }).find("cuda_context_low/high"), std::string::npos);
  d = est::cuda_device();
  d.workspace_bytes = -5;
  EXPECT_NE(argument_error([&] { est::estimate_memory(gpt2, {}, d); }).find("workspace_bytes"), std::string::npos);
  d = est::cuda_device();
  d.cuda_context_bytes = -1;
  EXPECT_NE(argument_error([&] { est::estimate_memory(gpt2, {}, d); }).find("cuda_context_bytes"),
            std::string::npos);
}

// ---- parameter counts: decimal with a suffix, nothing else -----------------------------------------

TEST(EstimatorParams, OnlyDecimalCountsWithSuffixesAreAccepted) {
  const std::vector<std::pair<std::string, int64_t>> good = {
      {"7B", 7000000000}, {"1.5b", 1500000000}, {"125M", 125000000}, {"350k", 350000}, {"2T", 2000000000000},
      {"6738415616", 6738415616}, {"8e9", 8000000000}, {"7g", 7000000000}, {"1.", 1}, {"9.2e18", 9200000000000000000}};
  for (const auto& [text, count] : good) EXPECT_EQ(est::parse_param_count(text), count) << text;
  for (const char* bad : {"0x10", "0X1p4", " 7B", "7B ", "+7", "-5", "0", "0.4", "inf", "nan", "infinity", "1e999",
                          "9.3e18", "7BB", "", ".", "1e", "e5", "7 B", "1,000", "7x", "\xff", "1e-999"}) {
    const std::string msg = argument_error([&] { est::parse_param_count(bad); });
    EXPECT_EQ(msg.rfind("params '", 0), 0u) << bad << ": " << msg;
  }
}

// ---- config files of the wrong kind or content -----------------------------------------------------

TEST(EstimatorConfig, NonRegularFilesAreRefusedWithoutBlocking) {
  const std::string dir = ::testing::TempDir() + "config_dir";
  ::mkdir(dir.c_str(), 0700);
  EXPECT_NE(argument_error([&] { est::model_from_hf_config_file(dir); }).find("is a directory"), std::string::npos);
  const std::string fifo = ::testing::TempDir() + "config_fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // A FIFO with no writer: opening it for reading would block forever.
  EXPECT_NE(argument_error([&] { est::model_from_hf_config_file(fifo); }).find("not a regular file"),
            std::string::npos);
  ::unlink(fifo.c_str());
  EXPECT_NE(argument_error([] { est::model_from_hf_config_file("/dev/zero"); }).find("not a regular file"),
            std::string::npos);
  EXPECT_NE(argument_error([] { est::model_from_hf_config_file(""); }).find("cannot be read"), std::string::npos);
  const std::string big = write_file("big_config.json", std::string((16 << 20) + 1, ' '));
  EXPECT_NE(argument_error([&] { est::model_from_hf_config_file(big); }).find("at most"), std::string::npos);
  std::remove(big.c_str());
}

TEST(EstimatorConfig, WrongJsonTypesAndValuesNameTheKey) {
  const std::string llama = R"("model_type": "llama", "vocab_size": 32000, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "intermediate_size": 64)";
  // (hidden_size value or extra fields, text the message must contain)
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("hidden_size": "64")", "'hidden_size' must be an integer"},
      {R"("hidden_size": 64.0)", "'hidden_size' must be an integer"},
      {R"("hidden_size": 64.5)", "'hidden_size'"},
      {R"("hidden_size": -64)", "'hidden_size'"},
      {R"("hidden_size": 0)", "'hidden_size'"},
      {R"("hidden_size": true)", "'hidden_size'"},
      {R"("hidden_size": [64])", "'hidden_size'"},
      {R"("hidden_size": {"a": 1})", "'hidden_size'"},
      {R"("hidden_size": 18446744073709551615)", "'hidden_size' must be an integer from 1 to 9223372036854775807"},
      {R"("hidden_size": 9223372036854775808)", "'hidden_size'"},
      {R"("hidden_size": null)", "'hidden_size' is missing"},
      {R"("hidden_size": 64, "head_dim": -1)", "'head_dim'"},
      {R"("hidden_size": 64, "num_key_value_heads": 3)", "num_kv_heads"},
      {R"("hidden_size": 64, "num_key_value_heads": 0)", "'num_key_value_heads'"},
      {R"("hidden_size": 64, "tie_word_embeddings": "yes")", "'tie_word_embeddings'"},
      {R"("hidden_size": 64, "attention_dropout": "0.1")", "'attention_dropout'"},
      {R"("hidden_size": 65)", "not divisible"},
  };
  for (const auto& [field, needle] : cases) {
    const std::string text = "{" + llama + ", " + field + "}";
    const std::string msg = argument_error([&] { est::model_from_hf_config(text, "c.json"); });
    EXPECT_NE(msg.find(needle), std::string::npos) << field << ": " << msg;
    EXPECT_NE(msg.find("c.json"), std::string::npos) << msg;
  }
  for (const char* text : {"", "[]", "42", "\"llama\"", "null", "{", "{\"model_type\": 5}", "{\"model_type\": \"t5\"}",
                           "{\"model_type\": \"gpt2\"}", "{\"model_type\": \"llama\", \"vocab_size\": 1e400}",
                           "{\"model_type\": \"bert\", \"vocab_size\": NaN}", "{\"model_type\": \"\xff\"}"}) {
    const std::string msg = argument_error([&] { est::model_from_hf_config(text, "c.json"); });
    EXPECT_NE(msg.find("c.json"), std::string::npos) << est::printable(text) << ": " << msg;
  }
}

TEST(EstimatorConfig, DeeplyNestedJsonIsAnErrorNotACrash) {
  const std::string deep =
      "{\"model_type\": \"gpt2\", \"x\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  EXPECT_NE(argument_error([&] { est::model_from_hf_config(deep, "deep.json"); }).find("deep.json"), std::string::npos);
}

// ---- defect 2: the command line --------------------------------------------------------------------

TEST(CliHostile, ReportedCasesExitTwoWithOneLine) {
  const std::string dir = ::testing::TempDir() + "cli_config_dir";
  ::mkdir(dir.c_str(), 0700);
  const std::string fifo = ::testing::TempDir() + "cli_config_fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string bad_utf8 = write_file("bad_utf8.json", "{\"model_type\": \"gpt2\xff\"}");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"estimate", "--model", "llama-2-7b", "--seq", "3000000000", "--attention", "eager"}, "seq"},
      {{"estimate", "--params", "8e18"}, "params '8e18'"},
      {{"estimate", "--model", "llama-2-7b", "--batch", "4611686018427387904"}, "batch"},
      {{"estimate", "--model", "llama-2-7b", "--seq", "9223372036854775808"},
       "--seq '9223372036854775808' is out of range"},
      {{"estimate", "--model", "llama-2-7b", "--batch", "-9223372036854775809"}, "--batch"},
      {{"estimate", "--config", bad_utf8}, bad_utf8},
      {{"estimate", "--config", fifo}, "not a regular file"},
      {{"estimate", "--config", dir}, "is a directory"},
      {{"estimate", "--model", "gpt2", "--gpu", ""}, "gpu ''"},
      {{"estimate", "--params", "0x10"}, "params '0x10'"},
      {{"estimate", "--model", "gpt2", "--batch", "0x10"}, "--batch '0x10' is not a decimal integer"},
      {{"estimate", "--model", "gpt2", "--batch", "4.0"}, "--batch"},
      {{"estimate", "--model", "gpt2", "--batch", "1e3"}, "--batch"},
      {{"estimate", "--model", "gpt2", "--batch", " 4"}, "--batch"},
      {{"estimate", "--model", "gpt2", "--batch", "+4"}, "--batch"},
      {{"estimate", "--model", "gpt2", "--batch", ""}, "--batch"},
      {{"estimate", "--model", "gpt2", "--seq", "nan"}, "--seq"},
      {{"estimate", "--model", "gpt2", "--zero", "4294967296"}, "zero stage 4294967296"},
      {{"estimate", "--model", "gpt2", "--gpus", "99999999999999999999"}, "--gpus"},
      {{"estimate", "--model", "gpt2", "--lora-rank", "inf"}, "--lora-rank"},
      {{"estimate", "--model", "gpt2", "--grad-accum", "-0x1"}, "--grad-accum"},
      {{"estimate", "--model", "gpt2", "--batch", "1099511627776", "--grad-accum", "1099511627776"},
       "global batch"},
      {{"estimate", "--model", ""}, "model ''"},
      {{"estimate", "--model", "\xff\xfe"}, "model '\\xff\\xfe'"},
      {{"estimate", "--model", "gpt2", "--precision", "\xc3"}, "precision '\\xc3'"},
      {{"estimate", "--config", "/nonexistent/\xff.json"}, "\\xff.json"},
      {{"estimate", "--\xff"}, "\\xff"},
      {{"estimate", "--model", "gpt2", "--device", ""}, "device"},
      {{"estimate", "--model", "gpt2", "--checkpointing", "every:99999999999"}, "checkpointing"},
      {{"estimate", "--model", "gpt2", "--lora-rank", "8", "--lora-targets", ""}, "lora-targets"},
      {{"\xff"}, "command '\\xff'"},
  };
  for (const auto& [args, needle] : cases) expect_one_error_line(run(args), args, needle);
  ::unlink(fifo.c_str());
}

namespace {
// A stream whose every write fails, as std::cout on a full disk.
class FailingBuffer : public std::streambuf {
 protected:
  int_type overflow(int_type) override { return traits_type::eof(); }
  std::streamsize xsputn(const char*, std::streamsize) override { return 0; }
};
}  // namespace

TEST(CliHostile, OutputThatCannotBeWrittenExitsOneWithOneLine) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"estimate", "--model", "gpt2"}, {"gpus", "--json"}, {"presets"}, {"--help"}, {"estimate", "--help"}}) {
    FailingBuffer failing;
    std::ostream out(&failing);
    std::ostringstream err;
    EXPECT_EQ(gpuops::run_cli(args, out, err), 1) << joined(args);
    const std::string message = err.str();
    EXPECT_EQ(message.rfind("gpuops: error: cannot write the output", 0), 0u) << message;
    EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 1) << message;
  }
}

TEST(CliHostile, NonUtf8NamesReachTheOutputAsValidText) {
  const std::string path = write_file("cfg_\xff.json", R"({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768,
      "n_layer": 2, "n_head": 12, "n_positions": 1024})");
  Result r = run({"estimate", "--config", path, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NO_THROW(json::parse(r.out));  // the name's byte became U+FFFD, not a dump error
  r = run({"estimate", "--config", path});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("cfg_\\xff.json"), std::string::npos);
  std::remove(path.c_str());
}

TEST(CliHostile, RandomArgumentsGiveZeroOrOneErrorLine) {
  // Options drawn with hostile values: every run ends with exit 0 and a JSON document whose categories are
  // non-negative and add up, or exit 2 and one printable error line.
  const std::vector<std::string> options = {"--model", "--params", "--precision", "--amp", "--optimizer",
                                            "--optimizer-impl", "--zero", "--gpus", "--checkpointing", "--attention",
                                            "--lora-rank", "--lora-targets", "--base-dtype", "--batch", "--seq",
                                            "--grad-accum", "--device", "--gpu"};
  const std::vector<std::string> values = {
      "", "0", "1", "2", "3", "-1", "8", "64", "4096", "65536", "3000000000", "4611686018427387904",
      "9223372036854775807", "9223372036854775808", "-9223372036854775808", "1e3", "0x10", "nan", "inf", "7B",
      "8e18", "1.5", "gpt2", "llama-2-7b", "bert-base", "mistral-7b", "fp32", "bf16", "fp16-mixed", "master-copy",
      "adamw-8bit", "sgd", "fused", "full", "every:2", "every:0", "eager", "flash", "q,v", "q,q", "nf4", "int8",
      "cpu", "cuda", "H100", "\xff", "every:99999999999999999999", "a\nb"};
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seed = rng();
  rng.seed(seed);
  for (int i = 0; i < 200; ++i) {
    std::vector<std::string> args = {"estimate", "--json"};
    for (int k = 1 + rng() % 4; k > 0; --k) {
      args.push_back(options[rng() % options.size()]);
      args.push_back(values[rng() % values.size()]);
    }
    SCOPED_TRACE(::testing::Message() << "seed " << seed << ": " << joined(args));
    const Result r = run(args);
    ASSERT_TRUE(r.code == 0 || r.code == 2) << r.err;
    if (r.code == 2) {
      expect_one_error_line(r, args, "gpuops: error: ");
      continue;
    }
    const json doc = json::parse(r.out);
    for (const auto& one : doc.at("runs")) {
      int64_t sum = 0;
      for (const auto& [key, value] : one.at("breakdown").items()) {
        if (key == "peak_phase") continue;
        EXPECT_GE(value.get<int64_t>(), 0) << key;
        // The figures derived from the categories, and host memory, which is on no device:
        if (key == "total" || key == "allocated_peak" || key == "reserved_peak" || key == "total_low" ||
            key == "total_high" || key == "host_memory")
          continue;
        EXPECT_GE(value.get<int64_t>(), 0) << key;
        sum += value.get<int64_t>();
      }
      EXPECT_EQ(one["breakdown"]["total"].get<int64_t>(), sum);
    }
  }
}
