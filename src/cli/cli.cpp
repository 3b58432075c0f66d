// `gpuops` command line: parses arguments with CLI11, builds the estimator inputs, hands the results to
// report.cpp. Every bad input ends as one "gpuops: error: ..." line and exit status 2; output that
// cannot be written, as one line and exit status 1.
#include "gpuops/cli.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "gpuops/plot_svg.h"
#include "report.h"

namespace gpuops {
namespace {
namespace est = gpuops::estimator;

constexpr int kFailure = 1;
constexpr int kBadInput = 2;

// A --plot file that could not be written (exit 1, like output that cannot be written).
struct PlotWriteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Integer options are read as text and converted by parse_integer: CLI11 reads them with strtoll in
// base 0 (so "010" was 8 and "0x10" 16) and clamps values past int64 without a word.
struct EstimateOptions {
  std::string model, config, params;
  std::string precision = "bf16-mixed", amp = "autocast", optimizer = "adamw", optimizer_impl = "default";
  std::string checkpointing = "none", attention = "sdpa";
  std::string base_dtype = "bf16", bnb_version = "0.45.0", device = "cuda", gpu;
  std::string zero = "0", gpus = "1", lora_rank = "0", batch = "1", seq = std::to_string(est::kDefaultSeqLen),
              grad_accum = "1", zero_grad = "none", zero_reduce = "backward", zero_bucket_bytes = "0";
  std::vector<std::string> lora_targets = {"q", "v"};
  bool recommend = false, json = false;
  // Optimizer placement and sharding (docs/estimator.md, "Optimizers, offload and sharding"):
  std::string sharding = "flat", reshard_after_forward = "true", reduce_dtype = "grad", zero_prefetch = "1";
  std::string ds_reduce_bucket = "500000000";
  bool offload_optimizer = false, quantize_lm_head = false, fsdp_orig_params = false;
  // The CUDA software (docs/estimator.md, "Three figures"):
  std::string cuda = "13", module_loading = "lazy", allocator = "default", context_bytes = "-1", device_profile;
  // Pictures and advice (docs/estimator.md, "Pictures and advice"):
  std::string plot;    ///< --plot FILE.svg
  std::string advise;  ///< --advise GPU
  // Activation-side setups (docs/estimator.md, "Checkpointing policies, chunked loss, LoRA dropout, torch.compile"):
  std::string loss = "standard", lora_dropout = "0", held_logits = "none", model_code = "hf";
  bool compile = false;
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
  s.lora.bnb_version = est::parse_bnb_version(o.bnb_version);
  s.micro_batch = parse_integer("--batch", o.batch);
  s.seq_len = seq_given ? parse_integer("--seq", o.seq) : est::default_seq_len(model);
  s.grad_accum = parse_integer("--grad-accum", o.grad_accum);
  s.grads_set_to_none = est::parse_zero_grad(o.zero_grad);
  s.zero_reduce_at_step = est::parse_zero_reduce(o.zero_reduce);
  s.zero_bucket_bytes = parse_integer("--zero-bucket-bytes", o.zero_bucket_bytes);
  est::parse_loss(o.loss, s);
  s.lora_dropout = est::parse_lora_dropout(o.lora_dropout);
  s.compile = o.compile;
  s.held_logits = est::parse_held_logits(o.held_logits);
  s.model_code = est::parse_model_code(o.model_code);
  s.sharding = est::parse_sharding(o.sharding);
  if (s.sharding != est::ShardingLayout::Flat && s.zero_stage == 0) s.zero_stage = 3;  // fsdp2, gpuops, fsdp1: 3
  s.zero_prefetch = parse_integer("--zero-prefetch", o.zero_prefetch);
  s.ds_reduce_bucket = est::parse_ds_reduce_bucket(o.ds_reduce_bucket);
  s.reshard_after_forward = est::parse_bool(o.reshard_after_forward, "--reshard-after-forward");
  s.reduce_dtype = est::parse_reduce_dtype(o.reduce_dtype);
  s.offload_optimizer = o.offload_optimizer;
  s.fsdp_orig_params = o.fsdp_orig_params;
  s.lora.quantize_lm_head = o.quantize_lm_head;
  est::validate(s, model);
  return s;
}

// The --advise GPU, with an error that names the option.
const est::GpuModel& find_advise_gpu(const std::string& name) {
  try {
    return est::find_gpu(name);
  } catch (const ArgumentError& e) {
    throw ArgumentError(fmt::format("--advise: {}", e.what()));
  }
}

// --plot: one panel per run, written atomically before anything is printed; a file that cannot be
// written is an output failure (exit 1) naming --plot.
void write_plot(const std::vector<cli::Run>& runs, const EstimateOptions& o, bool gpu_given) {
  const est::GpuModel* line = gpu_given ? &est::find_gpu(o.gpu) : nullptr;
  std::vector<EstimatePlot> plots;
  for (const cli::Run& r : runs) {
    plots.push_back(make_estimate_plot(r.model, r.setup, r.profile, line, r.runtime));
    plots.back().title = r.label;
  }
  const std::string svg = render_estimate_svg(plots);
  try {
    write_file_atomically(o.plot, svg);
  } catch (const std::system_error& e) {
    throw PlotWriteError(fmt::format("--plot '{}': cannot write the picture ({})", o.plot, e.what()));
  }
}

// The CUDA software of the job: what sizes the context and how the allocator reserves.
est::CudaRuntime build_runtime(const EstimateOptions& o) {
  est::CudaRuntime rt;
  const int64_t cuda = parse_integer("--cuda", o.cuda);
  GPUOPS_CHECK_ARG(cuda >= 11 && cuda <= 13, "--cuda {} is not accepted; accepted: 11, 12, 13 (the CUDA major "
                   "version of the torch build)", cuda);
  rt.cuda_major = static_cast<int>(cuda);
  GPUOPS_CHECK_ARG(o.module_loading == "lazy" || o.module_loading == "eager", "--module-loading '{}' is not "
                   "accepted; accepted: lazy, eager", o.module_loading);
  rt.lazy_loading = o.module_loading == "lazy";
  GPUOPS_CHECK_ARG(o.allocator == "default" || o.allocator == "expandable", "--allocator '{}' is not accepted; "
                   "accepted: default, expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", o.allocator);
  rt.allocator = o.allocator == "expandable" ? est::AllocatorMode::ExpandableSegments : est::AllocatorMode::Default;
  rt.context_bytes = parse_integer("--context-bytes", o.context_bytes);
  GPUOPS_CHECK_ARG(rt.context_bytes >= -1 && rt.context_bytes <= (int64_t{1} << 40), "--context-bytes {} is not "
                   "accepted; accepted: 0 to 1099511627776 (what nvidia-smi shows minus max_memory_reserved)",
                   rt.context_bytes);
  if (!o.device_profile.empty()) rt.measured = est::read_device_profile(o.device_profile, "--device-profile");
  return rt;
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
  const est::CudaRuntime runtime = build_runtime(o);
  // The breakdown's CUDA profile: the --gpu's, else the --advise GPU's (so that its note and "as given" are that
  // GPU's), else an H100's (torch 2.11's CUDA 13 by default).
  const est::DeviceProfile cuda = gpu_given            ? est::device_of(est::find_gpu(o.gpu), runtime)
                                  : !o.advise.empty() ? est::device_of(find_advise_gpu(o.advise), runtime)
                                                      : est::cuda_device(90, runtime);
  r.breakdown = est::estimate_memory(model, setup, o.device == "cuda" ? cuda : est::cpu_device());
  r.recommend = o.recommend;
  r.gpus = o.recommend ? est::recommend(model, setup, runtime) : est::fit_catalog(model, setup, runtime);
  if (gpu_given) {  // an empty --gpu "" is an error, not "every GPU"
    const est::GpuModel& only = est::find_gpu(o.gpu);
    r.gpus.erase(std::remove_if(r.gpus.begin(), r.gpus.end(), [&](const est::GpuFit& f) { return f.gpu != &only; }),
                 r.gpus.end());
  }
  r.profile = o.device == "cuda" ? cuda : est::cpu_device();
  r.runtime = runtime;
  if (!o.advise.empty()) {
    r.advise_gpu = &find_advise_gpu(o.advise);
    r.advise_given = est::estimate_memory(model, setup, est::device_of(*r.advise_gpu, runtime));
    r.advice = est::advise(model, setup, *r.advise_gpu, runtime);
  }
  if (model.family == est::ModelFamily::ParamsOnly)
    r.notes.push_back("a bare parameter count has no architecture: activations and logits are not modelled "
                      "(use --model or --config for them)");
  if (o.device == "cpu") r.notes.push_back("the breakdown is for the CPU; the GPU table uses the CUDA profile");
  else r.notes.push_back(fmt::format("{}; band: -{:.0f}%/+{:.0f}% of the allocated bytes (what published runs' "
                                     "stacks changed), +-50% of the allocator's reserve and NCCL's buffers, the context's "
                                     "range", cuda.context_basis, 100 * est::kAllocatedBandBelow,
                                     100 * est::kAllocatedBandAbove));
  std::vector<std::string> no_precision;
  for (const auto& g : est::gpu_catalog())
    if (!est::runs_precision(g, setup.precision) && (!gpu_given || &g == &est::find_gpu(o.gpu)))
      no_precision.push_back(fmt::format("{} (sm_{})", g.name, g.compute_capability));
  if (!no_precision.empty())
    r.notes.push_back(fmt::format("{} has no bf16 tensor cores: {} runs there only as fp16-mixed (same memory, "
                                  "with a GradScaler){}", fmt::join(no_precision, ", "), est::to_string(setup.precision),
                                  o.recommend ? "; left out of the recommendation" : ""));
  if (setup.zero_stage > 0 && setup.num_gpus == 1)
    r.notes.push_back("ZeRO with one GPU partitions nothing: use --gpus N for the per-GPU share");
  if (r.breakdown.host_memory > 0)  // paged or offloaded optimizer state
    r.notes.push_back(fmt::format("{:.2f} GiB of optimizer state live in host RAM ({}): the fit also needs that much "
                                  "free host memory per GPU", static_cast<double>(r.breakdown.host_memory) / (1 << 30),
                                  setup.offload_optimizer ? "--offload-optimizer"
                                                          : "paged: evicted to the host under pressure; the device "
                                                            "figure is the least it needs"));
  // What was assumed reading the model's config (unknown model_type, MLA, softcapping, sliding window).
  r.notes.insert(r.notes.end(), model.assumptions.begin(), model.assumptions.end());
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
  lora.seq_len = est::kDefaultSeqLen;
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

std::string fit_table_json(const estimator::ModelSpec& model, const estimator::TrainingSetup& setup,
                           const estimator::CudaRuntime& runtime, bool recommend) {
  const auto fits = recommend ? est::recommend(model, setup, runtime) : est::fit_catalog(model, setup, runtime);
  return cli::fits_json(fits, model.family == est::ModelFamily::ParamsOnly)
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  CLI::App app{"gpuops: estimate the GPU memory of training a model, and which GPUs fit it", "gpuops"};
  app.require_subcommand(1);

  EstimateOptions o;
  CLI::App* estimate = app.add_subcommand(
      "estimate", "Estimate peak memory per GPU of one training step; no options: a 7B LoRA and full fine-tune");
  CLI::Option* model = estimate->add_option("--model", o.model, "Built-in preset (see `gpuops presets`), or a Hugging Face Hub id (org/name) whose config.json is in the local Hub cache (no download)");
  CLI::Option* config = estimate->add_option("--config", o.config,
                                                "Hugging Face config.json: gpt2, bert or any decoder-only model "
                                                "(Llama, Gemma-2, Phi-3, Mixtral, Qwen-MoE, DeepSeek, ...)");
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
      estimate->add_option("--optimizer", o.optimizer, "adamw, adam, sgd, sgd-momentum, adamw-8bit, adafactor, "
                           "paged-adamw-8bit, paged-adamw-32bit or gpuops-adamw-8bit")
          ->capture_default_str(),
      estimate->add_option("--optimizer-impl", o.optimizer_impl, "default (torch's for the device), for-loop, "
                           "foreach or fused")->capture_default_str(),
      estimate->add_option("--zero", o.zero, "ZeRO stage 0-3")->type_name("INT")->capture_default_str(),
      estimate->add_option("--gpus", o.gpus, "Data-parallel GPUs (ZeRO divides by this)")
          ->type_name("INT")
          ->capture_default_str(),
      estimate->add_option("--checkpointing", o.checkpointing, "none, full, every:K or selective (op-level, "
                           "torchtitan's policy)")->capture_default_str(),
      estimate->add_option("--attention", o.attention, "eager, sdpa (torch's, as Hugging Face calls it) or flash")->capture_default_str(),
      estimate->add_option("--lora-rank", o.lora_rank, "LoRA rank, 0 = full fine-tune")
          ->type_name("INT")
          ->capture_default_str(),
      estimate->add_option("--lora-targets", o.lora_targets, "Comma list of q,k,v,o,gate,up,down (the blocks' projections), "
                           "lm_head, embed")
          ->delimiter(',')
          ->capture_default_str(),
      estimate->add_option("--base-dtype", o.base_dtype, "Frozen LoRA base: fp16, bf16, int8, nf4 (double "
                           "quantisation), nf4-nodq or fp32 (an fp32 model)")
          ->capture_default_str(),
      estimate->add_option("--bnb-version", o.bnb_version, "bitsandbytes release of an int8/nf4 base (what its "
                           "matmuls keep changed in 0.43.2 and 0.45.0; later releases behave as 0.45.0)")
          ->type_name("X.Y.Z")
          ->capture_default_str(),
      estimate->add_option("--batch", o.batch, "Micro-batch per GPU")->type_name("INT")->capture_default_str(),
      seq_option,
      estimate->add_option("--grad-accum", o.grad_accum, "Gradient accumulation steps")
          ->type_name("INT")
          ->capture_default_str(),
      estimate->add_option("--zero-reduce", o.zero_reduce, "ZeRO 1-2: gradients reduced in buckets during the "
                           "backward (DeepSpeed, Megatron) or at the step (gpuops' ZeroOptimizer)")
          ->type_name("backward|step")
          ->capture_default_str(),
      estimate->add_option("--zero-bucket-bytes", o.zero_bucket_bytes, "ZeRO 1-2 reduced in the backward by gpuops' "
                           "ZeroOptimizer(reduce_in_backward, bucket_bytes=B): its buckets in flight (0: DeepSpeed's "
                           "and Megatron's buffers, not counted)")
          ->type_name("B")
          ->capture_default_str(),
      estimate->add_option("--zero-grad", o.zero_grad, "Between steps the gradients are: none "
                           "(zero_grad(set_to_none=True), torch >= 2.0) or zeros (kept, torch < 2.0)")
          ->capture_default_str(),
      estimate->add_option("--loss", o.loss, "standard (HF cross-entropy, logits upcast to fp32), no-upcast "
                           "(cross-entropy on 16-bit logits outside autocast: thunder's benchmark), chunked:C (torchtune's, "
                           "LitGPT's chunked cross-entropy, C token chunks, upcast), chunked-no-upcast:C or fused-linear-ce "
                           "(Liger)")->capture_default_str(),
      estimate->add_option("--lora-dropout", o.lora_dropout, "PEFT lora_dropout, 0 <= P < 1 (LoRA only)")
          ->type_name("P")
          ->capture_default_str(),
      estimate->add_flag("--compile", o.compile, "torch.compile the model (inductor's saved tensors)"),
      estimate->add_option("--held-logits", o.held_logits, "Logits the training loop keeps through the backward: none "
                           "(only the loss), model (out = model(...); out.loss.backward()) or fp32 (torchtune < 0.3)")
          ->capture_default_str(),
      estimate->add_option("--model-code", o.model_code, "The model's implementation: hf (transformers) or litgpt "
                           "(LitGPT's GPT: one fused q|k|v linear on every architecture)")->capture_default_str(),
      estimate->add_option("--sharding", o.sharding, "ZeRO-3 layout: flat (DeepSpeed's flat partitions), fsdp2 "
                           "(torch fully_shard, per-tensor dim-0 shards), gpuops (gpuops.ZeroOptimizer stage 3: "
                           "a flat buffer per block) or fsdp1 (torch FullyShardedDataParallel FULL_SHARD: flat "
                           "partitions, the root unit gathered from forward to backward end); fsdp2, gpuops and "
                           "fsdp1 imply --zero 3")->capture_default_str(),
      estimate->add_option("--reshard-after-forward", o.reshard_after_forward, "fsdp2, gpuops: true (re-gather in "
                           "backward) or false (blocks stay unsharded from forward to backward)")->capture_default_str(),
      estimate->add_option("--zero-prefetch", o.zero_prefetch, "gpuops: units gathered ahead of the one running "
                           "(ZeroOptimizer's prefetch), 0 to 64")->type_name("K")->capture_default_str(),
      estimate->add_option("--ds-reduce-bucket", o.ds_reduce_bucket, "DeepSpeed ZeRO-3 (zero 3, sharding flat): its "
                           "reduce_bucket_size in elements, the gradient bucket it makes at setup (DeepSpeed's default "
                           "5e8, which accelerate's configs keep; auto: Hugging Face's hidden_size^2; 0: "
                           "contiguous_gradients off)")->type_name("N|auto")->capture_default_str(),
      estimate->add_option("--reduce-dtype", o.reduce_dtype, "fsdp2: MixedPrecisionPolicy reduce_dtype, grad (None: the "
                           "gradients' dtype) or fp32 (torchtitan's)")->capture_default_str(),
      estimate->add_flag("--offload-optimizer", o.offload_optimizer, "ZeRO-Offload: optimizer states, fp32 master and "
                         "the step on the host (host memory reported apart)"),
      estimate->add_flag("--fsdp-orig-params", o.fsdp_orig_params, "fsdp1: use_orig_params=True (with LoRA the frozen "
                         "weights save their inputs and get gradients as trainable ones)"),
      estimate->add_flag("--quantize-lm-head", o.quantize_lm_head, "int8/nf4 LoRA base: store the LM head like the "
                         "base linears (default: 16-bit)"),
  };
  estimate->add_option("--device", o.device, "Profile of the breakdown: cuda or cpu")->capture_default_str();
  estimate->add_option("--cuda", o.cuda, "CUDA major version of the torch build: 11, 12 or 13")->capture_default_str();
  estimate->add_option("--module-loading", o.module_loading, "CUDA_MODULE_LOADING: lazy (torch's default) or eager")
      ->capture_default_str();
  estimate->add_option("--allocator", o.allocator, "Caching allocator: default or expandable (expandable_segments)")
      ->capture_default_str();
  estimate->add_option("--context-bytes", o.context_bytes, "Measured CUDA context in bytes (nvidia-smi minus "
                       "max_memory_reserved) instead of the table's")->type_name("INT");
  CLI::Option* profile_option = estimate->add_option(
      "--device-profile", o.device_profile, "A device-profile.json measured on a GPU (calibrate_device.py): its CUDA "
      "context and workspaces replace the table's for GPUs of its compute capability")->type_name("FILE");
  CLI::Option* gpu_option =
      estimate->add_option("--gpu", o.gpu, "Show only this catalog GPU (see `gpuops gpus`)");
  estimate->add_flag("--recommend", o.recommend, "Only the GPUs that fit, cheapest first");
  estimate->add_flag("--json", o.json, "One JSON document instead of tables");
  CLI::Option* plot_option = estimate->add_option(
      "--plot", o.plot, "Also write an SVG picture: memory per moment of the step, largest micro-batch per GPU")
      ->type_name("FILE.svg");
  CLI::Option* advise_option = estimate->add_option(
      "--advise", o.advise,
      "What to change to fit on this catalog GPU: every modeled lever (loss, checkpointing, micro-batch, offload, "
      "ZeRO, optimizer, LoRA...), cheapest first")
      ->type_name("GPU");

  bool gpus_json = false, presets_json = false;
  CLI::App* gpus = app.add_subcommand("gpus", "List the GPU catalog");
  gpus->add_flag("--json", gpus_json, "JSON instead of a table");
  CLI::App* presets = app.add_subcommand("presets", "List the built-in model presets");
  presets->add_flag("--json", presets_json, "JSON instead of a table");

  try {
    if (args.size() == 1 && args[0] == "--version") {
      out << "gpuops " << GPUOPS_VERSION_STRING << "\n";
      return finish(0, out, err);
    }
    // CLI11 reports a missing or unknown command without naming it; say which ones exist.
    const bool known = !args.empty() && (args[0] == "estimate" || args[0] == "gpus" || args[0] == "presets" ||
                                         args[0] == "--help" || args[0] == "-h");
    if (!known)
      throw ArgumentError(fmt::format("command '{}' is not accepted; accepted: estimate, gpus, presets (or --help, --version)",
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

    GPUOPS_CHECK_ARG(plot_option->count() == 0 || !o.plot.empty(), "--plot '' is not a file name; accepted: a path "
                     "such as estimate.svg");
    GPUOPS_CHECK_ARG(plot_option->count() == 0 || is_svg_name(o.plot), "--plot '{}': the picture is SVG; give a "
                     "name ending in .svg (no PNG or other format is written)", est::printable(o.plot));
    GPUOPS_CHECK_ARG(profile_option->count() == 0 || !o.device_profile.empty(), "--device-profile '' is not a file "
                     "name; accepted: the path of a device-profile.json");
    GPUOPS_CHECK_ARG(advise_option->count() == 0 || !o.advise.empty(), "--advise '' is not a GPU; accepted: a name "
                     "from `gpuops gpus`");
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
        spec = est::model_by_name(o.model);
      } else {
        spec = est::preset("llama-2-7b");
        note = "no --model, --config or --params given: using llama-2-7b";
      }
      const est::TrainingSetup setup = build_setup(o, spec, seq_option->count() > 0);
      runs.push_back(make_run(fmt::format("{} of {}", setup.lora.rank > 0 ? "LoRA fine-tune" : "full fine-tune",
                                          spec.name), spec, setup, o, gpu_option->count() > 0));
      if (!note.empty()) runs.back().notes.insert(runs.back().notes.begin(), note);
    }
    if (plot_option->count() > 0) {
      write_plot(runs, o, gpu_option->count() > 0);
      // On stderr: stdout stays the report (or the JSON) alone.
      err << fmt::format("gpuops: wrote the picture of {} run{} to {}\n", runs.size(), runs.size() == 1 ? "" : "s",
                         est::printable(o.plot));
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
  } catch (const PlotWriteError& e) {
    err << "gpuops: error: " << one_line(e.what()) << '\n';
    return kFailure;
  } catch (const std::exception& e) {
    err << "gpuops: error: internal error: " << one_line(e.what()) << '\n';
    return kFailure;
  } catch (...) {
    err << "gpuops: error: internal error: unknown exception\n";
    return kFailure;
  }
}

}  // namespace gpuops
