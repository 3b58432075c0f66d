#include "report.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

namespace gpuops::cli {
namespace est = gpuops::estimator;
using nlohmann::json;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double gib(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }

// 6738415616 -> "6.74B"
std::string short_count(int64_t n) {
  const double v = static_cast<double>(n);
  if (v >= 1e9) return fmt::format("{:.2f}B", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{}", n);
}

// Optimizer placement and sharding, when not the defaults.
std::string describe_state_options(const est::TrainingSetup& s) {
  std::string out;
  if (s.sharding == est::ShardingLayout::Fsdp2)
    out += fmt::format(", FSDP2 (reshard after forward {}, reduce in {})", s.reshard_after_forward ? "true" : "false",
                       est::to_string(s.reduce_dtype));
  if (s.sharding == est::ShardingLayout::Gpuops)
    out += fmt::format(", gpuops ZeroOptimizer stage 3 (reshard after forward {}, prefetch {})",
                       s.reshard_after_forward ? "true" : "false", s.zero_prefetch);
  if (s.sharding == est::ShardingLayout::Fsdp1)
    out += s.fsdp_orig_params ? ", FSDP1 FULL_SHARD (use_orig_params)" : ", FSDP1 FULL_SHARD";
  if (s.zero_stage == 3 && s.sharding == est::ShardingLayout::Flat)
    out += fmt::format(", DeepSpeed reduce bucket {} elements", est::ds_reduce_bucket_to_string(s.ds_reduce_bucket));
  if (s.zero_reduce_at_step) out += ", gradients reduced at the step (gpuops ZeroOptimizer)";
  if (s.zero_bucket_bytes > 0)
    out += fmt::format(", gradients reduced in the backward in {}-byte buckets (gpuops ZeroOptimizer)", s.zero_bucket_bytes);
  if (s.offload_optimizer) out += ", optimizer offloaded to the host";
  if (s.lora.quantize_lm_head) out += fmt::format(", LM head in {}", est::to_string(s.lora.base));
  if (s.lora.rank > 0 && est::is_quantised_base(s.lora.base) && s.lora.bnb_version < est::BnbVersion{})
    out += fmt::format(", bitsandbytes {}", est::to_string(s.lora.bnb_version));
  if (s.loss != est::LossKind::Standard || !s.loss_upcast) out += fmt::format(", loss {}", est::loss_to_string(s));
  if (s.lora_dropout > 0) out += fmt::format(", LoRA dropout {}", s.lora_dropout);
  if (s.compile) out += ", torch.compile";
  if (s.held_logits != est::HeldLogits::None) out += fmt::format(", logits held ({})", est::to_string(s.held_logits));
  if (s.model_code != est::ModelCode::HuggingFace) out += fmt::format(", {} code", est::to_string(s.model_code));
  return out;
}

std::string describe_setup(const est::TrainingSetup& s) {
  std::string lora = s.lora.rank > 0 ? fmt::format("LoRA rank {} on {} ({} frozen base)", s.lora.rank,
                                                   fmt::join(s.lora.targets, ","), est::to_string(s.lora.base))
                                     : std::string("full fine-tune");
  const std::string amp = est::is_mixed(s.precision) ? fmt::format(" ({})", est::to_string(s.amp)) : "";
  const std::string impl =
      s.optimizer_impl == est::OptimizerImpl::Default ? "" : fmt::format(" ({})", est::to_string(s.optimizer_impl));
  return fmt::format("{}, precision {}{}, optimizer {}{}, micro-batch {}, seq {}, grad-accum {}, {} GPU(s), ZeRO {}, "
                     "checkpointing {}, attention {}",
                     lora, est::to_string(s.precision), amp, est::to_string(s.optimizer), impl, s.micro_batch, s.seq_len,
                     s.grad_accum, s.num_gpus, s.zero_stage, est::checkpointing_to_string(s),
                     est::to_string(s.attention)) + describe_state_options(s);
}

bool params_only(const Run& r) { return r.model.family == est::ModelFamily::ParamsOnly; }

json model_json(const est::ModelSpec& m, const est::TrainingSetup& s) {
  json j = {{"name", m.name},
            {"family", std::string(est::to_string(m.family))},
            {"parameters", est::parameter_count(m)},
            {"trainable_parameters", est::trainable_parameter_count(m, s)}};
  if (m.family != est::ModelFamily::ParamsOnly) {
    j["vocab_size"] = m.vocab_size;
    j["hidden_size"] = m.hidden_size;
    j["num_layers"] = m.num_layers;
    j["num_heads"] = m.num_heads;
    j["num_kv_heads"] = m.num_kv_heads;
    j["intermediate_size"] = m.intermediate_size;
    j["max_positions"] = m.max_positions;
  }
  // Model families: the config's model_type, MoE shape, and the assumptions made reading the config.
  if (!m.model_type.empty()) j["model_type"] = m.model_type;
  if (m.num_experts > 0) {
    j["num_experts"] = m.num_experts;
    j["experts_per_token"] = m.experts_per_token;
    j["moe_intermediate_size"] = m.moe_intermediate_size;
    j["moe_layers"] = est::moe_layer_count(m);
  }
  j["assumptions"] = m.assumptions;
  return j;
}

json setup_json(const est::TrainingSetup& s) {
  return {{"precision", std::string(est::to_string(s.precision))},
          {"amp", std::string(est::to_string(s.amp))},
          {"optimizer", std::string(est::to_string(s.optimizer))},
          {"optimizer_impl", std::string(est::to_string(s.optimizer_impl))},
          {"zero_stage", s.zero_stage},
          {"num_gpus", s.num_gpus},
          {"checkpointing", est::checkpointing_to_string(s)},
          {"attention", std::string(est::to_string(s.attention))},
          {"lora", {{"rank", s.lora.rank},
                    {"targets", s.lora.rank > 0 ? s.lora.targets : std::vector<std::string>{}},
                    {"base_dtype", std::string(est::to_string(s.lora.base))},
                    {"quantize_lm_head", s.lora.quantize_lm_head},
                    {"bnb_version", est::to_string(s.lora.bnb_version)}}},
          {"offload_optimizer", s.offload_optimizer},
          {"sharding", std::string(est::to_string(s.sharding))},
          {"reshard_after_forward", s.reshard_after_forward},
          {"fsdp_orig_params", s.fsdp_orig_params},
          {"zero_prefetch", s.zero_prefetch},
          {"ds_reduce_bucket", s.zero_stage != 3 || s.sharding != est::ShardingLayout::Flat ? json()
                               : s.ds_reduce_bucket == est::kDsReduceBucketAuto ? json("auto")
                                                                                : json(s.ds_reduce_bucket)},
          {"reduce_dtype", std::string(est::to_string(s.reduce_dtype))},
          {"micro_batch", s.micro_batch},
          {"seq_len", s.seq_len},
          {"grad_accum", s.grad_accum},
          {"zero_grad", s.grads_set_to_none ? "none" : "zeros"},
          {"zero_reduce", s.zero_reduce_at_step ? "step" : "backward"},
          {"zero_bucket_bytes", s.zero_bucket_bytes},
          {"global_batch", (est::CheckedInt(s.micro_batch) * s.grad_accum * s.num_gpus).get()},
          {"loss", est::loss_to_string(s)},
          {"lora_dropout", s.lora_dropout},
          {"held_logits", std::string(est::to_string(s.held_logits))},
          {"model_code", std::string(est::to_string(s.model_code))},
          {"compile", s.compile}};
}

// --advise: the setup as given on the GPU, then each alternative with its device figure.
void print_advice(const Run& r, std::ostream& out) {
  const est::GpuModel& g = *r.advise_gpu;
  const int64_t given = r.advise_given.total();
  const bool fits = est::fits_on(r.advise_given, g);
  fmt::print(out, "\nAdvice for {} ({:.2f} GiB): as given, {:.2f} GiB (CUDA estimate) {}", g.name, gib(g.memory_bytes),
             gib(given), fits ? fmt::format("fits, {:.2f} GiB headroom (memory minus the band's top).\n",
                                            gib(g.memory_bytes - r.advise_given.total_high()))
                              : std::string("does not fit.\n"));
  if (r.advice.empty()) {
    fmt::print(out, "  no change the estimator models lowers it\n");
    return;
  }
  if (!fits && !r.advice.front().fits)
    fmt::print(out, "  no single change or combination of up to three fits; closest first:\n");
  fmt::print(out, "  {:<4} {:>8} {:>8} {:>9} {:<13} {}\n", "fits", "GiB", "saved", "headroom", "cost",
             "change (options)");
  for (const est::Advice& a : r.advice)
    fmt::print(out, "  {:<4} {:>8.2f} {:>8.2f} {:>9.2f} {:<13} {} ({})\n", a.fits ? "yes" : "no",
               gib(a.breakdown.total()), gib(a.saved_bytes), gib(g.memory_bytes - a.breakdown.total_high()),
               est::to_string(a.cost), a.description, a.options);
  fmt::print(out, "  (fits first, then by cost: none < recompute < slower < communication < numerics, then by the "
             "memory saved; headroom: memory minus the band's top)\n");
}

json advice_json(const Run& r) {
  json list = json::array();
  for (const est::Advice& a : r.advice)
    list.push_back({{"description", a.description},
                    {"options", a.options},
                    {"changes", a.changes},
                    {"keeps_numerics", a.keeps_numerics},
                    {"cost", std::string(est::to_string(a.cost))},
                    {"saved_bytes", a.saved_bytes},
                    {"fits", a.fits},
                    {"total_bytes", a.breakdown.total()},
                    {"total_high_bytes", a.breakdown.total_high()},
                    {"headroom_bytes", r.advise_gpu->memory_bytes - a.breakdown.total_high()},
                    {"peak_phase", std::string(est::to_string(a.breakdown.peak_phase))},
                    {"setup", setup_json(a.setup)}});
  return list;
}

}  // namespace

// The categories, then the three figures (allocated, reserved, device used) with the band.
void print_breakdown(const Run& r, std::ostream& out) {
  const est::MemoryBreakdown& b = r.breakdown;
  fmt::print(out, "{:<22} {:>9}\n", fmt::format("Memory per GPU ({})", r.device), "GiB");
  for (const auto& [name, bytes] : b.items())
    if (r.device == "cuda" || bytes != 0) fmt::print(out, "  {:<20} {:>9.2f}\n", name, gib(bytes));
  fmt::print(out, "  {:<20} {:>9.2f}   max_memory_allocated, peak at {}\n", "allocated peak", gib(b.allocated_peak()),
             est::to_string(b.peak_phase));
  if (r.device == "cuda") {
    fmt::print(out, "  {:<20} {:>9.2f}   max_memory_reserved (caching allocator)\n", "reserved peak",
               gib(b.reserved_peak()));
    fmt::print(out, "  {:<20} {:>9.2f}   device used (nvidia-smi), band {:.2f} to {:.2f}\n", "total", gib(b.total()),
               gib(b.total_low()), gib(b.total_high()));
  } else {
    fmt::print(out, "  {:<20} {:>9.2f}\n", "total", gib(b.total()));
  }
  if (b.host_memory > 0) fmt::print(out, "  {:<20} {:>9.2f}   host RAM (not on the device)\n", "host memory", gib(b.host_memory));
  fmt::print(out, "\n");
}

json breakdown_json(const est::MemoryBreakdown& b) {
  json j = json::object();
  for (const auto& [name, bytes] : b.items()) j[name] = bytes;
  j["allocated_peak"] = b.allocated_peak();
  j["reserved_peak"] = b.reserved_peak();
  j["total"] = b.total();
  j["total_low"] = b.total_low();
  j["total_high"] = b.total_high();
  j["host_memory"] = b.host_memory;
  j["peak_phase"] = std::string(est::to_string(b.peak_phase));
  return j;
}

void print_runs(const std::vector<Run>& runs, std::ostream& out) {
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    if (i > 0) fmt::print(out, "\n");
    const int64_t params = est::parameter_count(r.model);
    const int64_t trainable = est::trainable_parameter_count(r.model, r.setup);
    fmt::print(out, "== {} ==\n", est::printable(r.label));  // names and paths may be any bytes
    fmt::print(out, "model: {} ({} parameters, {} trainable)\n", est::printable(r.model.name), short_count(params),
               short_count(trainable));
    fmt::print(out, "setup: {}\n\n", describe_setup(r.setup));
    print_breakdown(r, out);

    fmt::print(out, "{}\n", r.recommend ? "GPUs that fit, cheapest first (each on its own CUDA profile; fits = the "
                                          "top of the band fits; headroom = memory minus the band's top):"
                                        : "Fit per GPU (each on its own CUDA profile; fits = the top of the band fits; "
                                          "headroom = memory minus the band's top):");
    if (r.gpus.empty()) fmt::print(out, "  none of the catalog GPUs fits this setup\n");
    else
      fmt::print(out, "  {:<10} {:>10} {:>5} {:>10} {:>13} {:>16} {:>7}  {}\n", "GPU", "memory GiB", "fits",
                 "used GiB", "headroom GiB", "max micro-batch", "$/h", "precision");
    for (const auto& f : r.gpus) {
      const std::string max_b = params_only(r) ? std::string("-") : fmt::format("{}", f.max_micro_batch);
      fmt::print(out, "  {:<10} {:>10.2f} {:>5} {:>10.2f} {:>13.2f} {:>16} {:>7.2f}  {}\n", f.gpu->name,
                 gib(f.gpu->memory_bytes), f.fits ? "yes" : "no", gib(f.at_requested.total()),
                 gib(f.gpu->memory_bytes - f.at_requested.total_high()), max_b, f.gpu->spot_price_usd_per_hour,
                 f.precision_ok ? "ok" : fmt::format("no {} on sm_{}: use fp16-mixed", est::to_string(r.setup.precision),
                                                     f.gpu->compute_capability));
    }
    if (r.advise_gpu) print_advice(r, out);
    for (const auto& n : r.notes) fmt::print(out, "note: {}\n", est::printable(n));
  }
}

json fits_json(const std::vector<est::GpuFit>& fits, bool params_only) {
  json gpus = json::array();
  for (const auto& f : fits) {
    gpus.push_back({{"name", f.gpu->name},
                    {"memory_bytes", f.gpu->memory_bytes},
                    {"fits", f.fits},
                    {"precision_supported", f.precision_ok},
                    {"total_bytes", f.at_requested.total()},
                    {"total_high_bytes", f.at_requested.total_high()},
                    {"headroom_bytes", f.gpu->memory_bytes - f.at_requested.total_high()},
                    {"max_micro_batch", params_only ? json(nullptr) : json(f.max_micro_batch)},
                    {"spot_price_usd_per_hour", f.gpu->spot_price_usd_per_hour}});
  }
  return gpus;
}

json runs_json(const std::vector<Run>& runs) {
  json list = json::array();
  for (const Run& r : runs) {
    const json breakdown = breakdown_json(r.breakdown);
    const json gpus = fits_json(r.gpus, params_only(r));
    list.push_back({{"label", r.label},
                    {"model", model_json(r.model, r.setup)},
                    {"setup", setup_json(r.setup)},
                    {"device", r.device},
                    {"breakdown", breakdown},
                    {"recommend", r.recommend},
                    {"gpus", gpus},
                    {"notes", r.notes}});
    if (r.advise_gpu) {
      list.back()["advice_for"] = {{"gpu", r.advise_gpu->name},
                                   {"memory_bytes", r.advise_gpu->memory_bytes},
                                   {"total_bytes", r.advise_given.total()},
                                   {"total_high_bytes", r.advise_given.total_high()},
                                   {"fits", est::fits_on(r.advise_given, *r.advise_gpu)},
                                   {"headroom_bytes", r.advise_gpu->memory_bytes - r.advise_given.total_high()}};
      list.back()["advice"] = advice_json(r);
    }
  }
  return {{"runs", list}};
}

void print_gpus(std::ostream& out) {
  fmt::print(out, "{:<10} {:>10} {:>4} {:<17} {:>15} {:>14} {:>9}\n", "GPU", "memory GiB", "sm", "tensor precisions",
             "bandwidth GB/s", "16-bit TFLOPS", "spot $/h");
  for (const auto& g : est::gpu_catalog())
    fmt::print(out, "{:<10} {:>10.2f} {:>4} {:<17} {:>15.0f} {:>14} {:>9.2f}\n", g.name, gib(g.memory_bytes),
               g.compute_capability, est::precisions_of(g.compute_capability), g.bandwidth_gb_s,
               fmt::format("{:.0f} {}", g.tensor_tflops, est::supports_bf16(g.compute_capability) ? "bf16" : "fp16"),
               g.spot_price_usd_per_hour);
}

json gpu_json(const est::GpuModel& g) {
  json precisions = json::array({"fp32", "fp16"});
  if (est::supports_bf16(g.compute_capability)) precisions.push_back("bf16");
  if (est::supports_fp8(g.compute_capability)) precisions.push_back("fp8");
  return {{"name", g.name},
          {"memory_bytes", g.memory_bytes},
          {"compute_capability", fmt::format("{}.{}", g.compute_capability / 10, g.compute_capability % 10)},
          {"tensor_precisions", precisions},
          {"bandwidth_gb_s", g.bandwidth_gb_s},
          {"tensor_tflops", g.tensor_tflops},
          {"tensor_tflops_dtype", est::supports_bf16(g.compute_capability) ? "bf16" : "fp16"},
          {"nvlink", g.nvlink},
          {"spot_price_usd_per_hour", g.spot_price_usd_per_hour}};
}

json gpus_json() {
  json list = json::array();
  for (const auto& g : est::gpu_catalog()) list.push_back(gpu_json(g));
  return {{"gpus", list}};
}

void print_presets(std::ostream& out) {
  fmt::print(out, "{:<17} {:>15}  {}\n", "preset", "parameters", "architecture");
  for (const auto& name : est::preset_names()) {
    const est::ModelSpec m = est::preset(name);
    // MoE presets also show their experts (top-k of E).
    const std::string experts =
        m.num_experts > 0 ? fmt::format(", {} experts (top-{})", m.num_experts, m.experts_per_token) : "";
    fmt::print(out, "{:<17} {:>15}  {} layers, hidden {}, {} heads ({} kv), vocab {}{}\n", name,
               est::parameter_count(m), m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.vocab_size,
               experts);
  }
}

json presets_json() {
  json list = json::array();
  for (const auto& name : est::preset_names()) {
    const est::ModelSpec m = est::preset(name);
    list.push_back(model_json(m, est::TrainingSetup{}));
  }
  return {{"presets", list}};
}

}  // namespace gpuops::cli
