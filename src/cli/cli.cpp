// `gpuops` command line: parses arguments with CLI11, builds the estimator inputs, hands the results to
// report.cpp. Every bad input ends as one "gpuops: error: ..." line and exit status 2; output that
// cannot be written, as one line and exit status 1.
#include "gpuops/cli.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ostream.h>

#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "report.h"

namespace gpuops {
namespace {
namespace est = gpuops::estimator;

constexpr int kFailure = 1;
constexpr int kBadInput = 2;
constexpr int64_t kDefaultSeq = 2048;

// Integer options are read as text and converted by parse_integer: CLI11 reads them with strtoll in
// base 0 (so "010" was 8 and "0x10" 16) and clamps values past int64 without a word.
struct EstimateOptions {
  std::string model, config, params;
  std::string precision = "bf16-mixed", amp = "autocast", optimizer = "adamw", optimizer_impl = "default";
  std::string checkpointing = "none", attention = "sdpa";
  std::string base_dtype = "bf16", device = "cuda", gpu;
  std::string zero = "0", gpus = "1", lora_rank = "0", batch = "1", seq = std::to_string(kDefaultSeq),
              grad_accum = "1";
  std::vector<std::string> lora_targets = {"q", "v"};
  bool recommend = false, json = false;
};

// A decimal integer ([-]digits) that fits int64; ArgumentError naming `option` otherwise.
int64_t parse_integer(const char* option, const std::string& text) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value, 10);
  GPUOPS_CHECK_ARG(ec != std::errc::result_out_of_range, "{} '{}' is out of range; accepted: a decimal integer "
                   "from -9223372036854775808 to 9223372036854775807", option, text);
  GPUOPS_CHECK_ARG(ec == std::errc() && ptr == end, "{} '{}' is not a decimal integer; accepted: "
                   "digits, e.g. {} 4", option, text, option);
  return value;
}

// One message line: newlines folded, bytes that are not printable UTF-8 escaped.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return est::printable(s);
}

// The training setup from the options; `seq_given` false lets short-context models use their maximum.
est::TrainingSetup build_setup(const EstimateOptions& o, const est::ModelSpec& model, bool seq_given) {
  est::TrainingSetup s;
  s.precision = est::parse_precision(o.precision);
  s.amp = est::parse_amp_layout(o.amp);
  s.optimizer = est::parse_optimizer(o.optimizer);
  s.optimizer_impl = est::parse_optimizer_impl(o.optimizer_impl);
  const int64_t zero = parse_integer("--zero", o.zero);
  GPUOPS_CHECK_ARG(zero >= 0 && zero <= 3, "zero stage {} is not accepted; accepted: 0, 1, 2, 3", zero);
  s.zero_stage = static_cast<int>(zero);
  s.num_gpus = parse_integer("--gpus", o.gpus);
  est::parse_checkpointing(o.checkpointing, s);
  s.attention = est::parse_attention(o.attention);
  s.lora.rank = parse_integer("--lora-rank", o.lora_rank);
  s.lora.targets = o.lora_targets;
  s.lora.base = est::parse_base_dtype(o.base_dtype);
  s.micro_batch = parse_integer("--batch", o.batch);
  s.seq_len = parse_integer("--seq", o.seq);
  if (!seq_given && model.learned_positions) s.seq_len = std::min(s.seq_len, model.max_positions);
  s.grad_accum = parse_integer("--grad-accum", o.grad_accum);
  est::validate(s, model);
  return s;
}

cli::Run make_run(std::string label, const est::ModelSpec& model, const est::TrainingSetup& setup,
                  const EstimateOptions& o, bool gpu_given) {
  GPUOPS_CHECK_ARG(o.device == "cuda" || o.device == "cpu", "device '{}' is not accepted; accepted: cuda, cpu",
                   o.device);
  cli::Run r;
  r.label = std::move(label);
  r.model = model;
  r.setup = setup;
  r.device = o.device;
  r.breakdown = est::estimate_memory(model, setup, o.device == "cuda" ? est::cuda_device() : est::cpu_device());
  r.recommend = o.recommend;
  r.gpus = o.recommend ? est::recommend(model, setup) : est::fit_catalog(model, setup);
  if (gpu_given) {  // an empty --gpu "" is an error, not "every GPU"
    const est::GpuModel& only = est::find_gpu(o.gpu);
    r.gpus.erase(std::remove_if(r.gpus.begin(), r.gpus.end(), [&](const est::GpuFit& f) { return f.gpu != &only; }),
                 r.gpus.end());
  }
  if (model.family == est::ModelFamily::ParamsOnly)
    r.notes.push_back("a bare parameter count has no architecture: activations and logits are not modelled "
                      "(use --model or --config for them)");
  if (o.device == "cpu") r.notes.push_back("the breakdown is for the CPU; the GPU table uses the CUDA profile");
  if (setup.zero_stage > 0 && setup.num_gpus == 1)
    r.notes.push_back("ZeRO with one GPU partitions nothing: use --gpus N for the per-GPU share");
  return r;
}

// No model and no training option: the embedded example, a 7B model as a LoRA and as a full fine-tune.
std::vector<cli::Run> default_runs(const EstimateOptions& o, bool gpu_given) {
  const est::ModelSpec model = est::preset("llama-2-7b");
  est::TrainingSetup lora;
  lora.precision = est::Precision::Bf16Mixed;
  lora.optimizer = est::OptimizerKind::AdamW;
  lora.lora.rank = 16;
  lora.lora.targets = {"q", "k", "v", "o"};
  lora.lora.base = est::BaseWeightDtype::Bf16;
  lora.micro_batch = 1;
  lora.seq_len = kDefaultSeq;
  est::TrainingSetup full = lora;
  full.lora = est::LoraSetup{};
  return {make_run("default example 1/2: LoRA fine-tune of llama-2-7b (rank 16 on q,k,v,o, bf16 frozen base, "
                   "AdamW, seq 2048, micro-batch 1)", model, lora, o, gpu_given),
          make_run("default example 2/2: full fine-tune of llama-2-7b (bf16-mixed, AdamW, seq 2048, micro-batch 1)",
                   model, full, o, gpu_given)};
}

// Names and paths may hold bytes that are not UTF-8: written as U+FFFD rather than failing the dump.
void emit_json(const nlohmann::json& j, std::ostream& out) {
  out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
}

// Output that did not reach its destination (a full disk, a closed pipe) is a failure, not exit 0.
int finish(int code, std::ostream& out, std::ostream& err) {
  errno = 0;
  out.flush();
  if (out) return code;
  const int error = errno;
  err << "gpuops: error: cannot write the output" << (error != 0 ? fmt::format(" ({})", std::strerror(error)) : "")
      << '\n';
  return kFailure;
}

}  // namespace

int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  CLI::App app{"gpuops: estimate the GPU memory of training a model, and which GPUs fit it", "gpuops"};
  app.require_subcommand(1);

  EstimateOptions o;
  CLI::App* estimate = app.add_subcommand(
      "estimate", "Estimate peak memory per GPU of one training step; no options: a 7B LoRA and full fine-tune");
  CLI::Option* model = estimate->add_option("--model", o.model, "Built-in preset (see `gpuops presets`)");
  CLI::Option* config = estimate->add_option("--config", o.config, "Hugging Face config.json");
  CLI::Option* params = estimate->add_option("--params", o.params, "Bare parameter count: 7B, 125M, ...");
  model->excludes(config)->excludes(params);
  config->excludes(params);
  CLI::Option* seq_option =
      estimate->add_option("--seq", o.seq, "Sequence length (default 2048, or the model's maximum if smaller)")
          ->type_name("INT");
  const std::vector<CLI::Option*> training = {
      estimate->add_option("--precision", o.precision, "fp32, fp16-mixed, bf16-mixed or bf16 (pure)")
          ->capture_default_str(),
      estimate->add_option("--amp", o.amp, "Mixed-precision layout: autocast (fp32 weights) or master-copy "
                           "(16-bit weights + fp32 master)")->capture_default_str(),
      estimate->add_option("--optimizer", o.optimizer, "adamw, adam, sgd, sgd-momentum or adamw-8bit")
          ->capture_default_str(),
      estimate->add_option("--optimizer-impl", o.optimizer_impl, "default (torch's for the device), for-loop, "
                           "foreach or fused")->capture_default_str(),
      estimate->add_option("--zero", o.zero, "ZeRO stage 0-3")->type_name("INT")->capture_default_str(),
      estimate->add_option("--gpus", o.gpus, "Data-parallel GPUs (ZeRO divides by this)")
          ->type_name("INT")
          ->capture_default_str(),
      estimate->add_option("--checkpointing", o.checkpointing, "none, full or every:K")->capture_default_str(),
      estimate->add_option("--attention", o.attention, "eager, sdpa (torch's, as Hugging Face calls it) or flash")->capture_default_str(),
      estimate->add_option("--lora-rank", o.lora_rank, "LoRA rank, 0 = full fine-tune")
          ->type_name("INT")
          ->capture_default_str(),
      estimate->add_option("--lora-targets", o.lora_targets, "Comma list of q,k,v,o,gate,up,down")
          ->delimiter(',')
          ->capture_default_str(),
      estimate->add_option("--base-dtype", o.base_dtype, "Frozen LoRA base: fp16, bf16, int8 or nf4")
          ->capture_default_str(),
      estimate->add_option("--batch", o.batch, "Micro-batch per GPU")->type_name("INT")->capture_default_str(),
      seq_option,
      estimate->add_option("--grad-accum", o.grad_accum, "Gradient accumulation steps")
          ->type_name("INT")
          ->capture_default_str(),
  };
  estimate->add_option("--device", o.device, "Profile of the breakdown: cuda or cpu")->capture_default_str();
  CLI::Option* gpu_option =
      estimate->add_option("--gpu", o.gpu, "Show only this catalog GPU (see `gpuops gpus`)");
  estimate->add_flag("--recommend", o.recommend, "Only the GPUs that fit, cheapest first");
  estimate->add_flag("--json", o.json, "One JSON document instead of tables");

  bool gpus_json = false, presets_json = false;
  CLI::App* gpus = app.add_subcommand("gpus", "List the GPU catalog");
  gpus->add_flag("--json", gpus_json, "JSON instead of a table");
  CLI::App* presets = app.add_subcommand("presets", "List the built-in model presets");
  presets->add_flag("--json", presets_json, "JSON instead of a table");

  try {
    // CLI11 reports a missing or unknown command without naming it; say which ones exist.
    const bool known = !args.empty() && (args[0] == "estimate" || args[0] == "gpus" || args[0] == "presets" ||
                                         args[0] == "--help" || args[0] == "-h");
    if (!known)
      throw ArgumentError(fmt::format("command '{}' is not accepted; accepted: estimate, gpus, presets (or --help)",
                                      args.empty() ? "" : args[0]));
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 2.1 parses a reversed vector
    app.parse(reversed);

    if (gpus->parsed()) {
      gpus_json ? emit_json(cli::gpus_json(), out) : cli::print_gpus(out);
      return finish(0, out, err);
    }
    if (presets->parsed()) {
      presets_json ? emit_json(cli::presets_json(), out) : cli::print_presets(out);
      return finish(0, out, err);
    }

    const bool has_model = model->count() + config->count() + params->count() > 0;
    const bool has_training = std::any_of(training.begin(), training.end(), [](CLI::Option* t) { return t->count() > 0; });
    std::vector<cli::Run> runs;
    if (!has_model && !has_training) {
      runs = default_runs(o, gpu_option->count() > 0);
    } else {
      est::ModelSpec spec;
      std::string note;
      if (!o.config.empty() || config->count() > 0) {
        spec = est::model_from_hf_config_file(o.config);
      } else if (params->count() > 0) {
        spec = est::params_only_model(est::parse_param_count(o.params), o.params);
      } else if (model->count() > 0) {
        spec = est::preset(o.model);
      } else {
        spec = est::preset("llama-2-7b");
        note = "no --model, --config or --params given: using llama-2-7b";
      }
      const est::TrainingSetup setup = build_setup(o, spec, seq_option->count() > 0);
      runs.push_back(make_run(fmt::format("{} of {}", setup.lora.rank > 0 ? "LoRA fine-tune" : "full fine-tune",
                                          spec.name), spec, setup, o, gpu_option->count() > 0));
      if (!note.empty()) runs.back().notes.insert(runs.back().notes.begin(), note);
    }
    o.json ? emit_json(cli::runs_json(runs), out) : cli::print_runs(runs, out);
    return finish(0, out, err);
  } catch (const CLI::CallForHelp& e) {
    return finish(app.exit(e, out, err), out, err);
  } catch (const CLI::CallForAllHelp& e) {
    return finish(app.exit(e, out, err), out, err);
  } catch (const CLI::ParseError& e) {
    const std::string where = estimate->parsed() ? " estimate" : gpus->parsed() ? " gpus" : presets->parsed() ? " presets" : "";
    err << "gpuops: error: " << one_line(e.what()) << " (see 'gpuops" << where << " --help' for what is accepted)\n";
    return kBadInput;
  } catch (const ArgumentError& e) {
    err << "gpuops: error: " << one_line(e.what()) << '\n';
    return kBadInput;
  } catch (const std::exception& e) {
    err << "gpuops: error: internal error: " << one_line(e.what()) << '\n';
    return kFailure;
  } catch (...) {
    err << "gpuops: error: internal error: unknown exception\n";
    return kFailure;
  }
}

}  // namespace gpuops
