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
                     est::to_string(s.attention));
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
                    {"base_dtype", std::string(est::to_string(s.lora.base))}}},
          {"micro_batch", s.micro_batch},
          {"seq_len", s.seq_len},
          {"grad_accum", s.grad_accum},
          {"global_batch", (est::CheckedInt(s.micro_batch) * s.grad_accum * s.num_gpus).get()}};
}

}  // namespace

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
    fmt::print(out, "{:<22} {:>9}\n", fmt::format("Memory per GPU ({})", r.device), "GiB");
    for (const auto& [name, bytes] : r.breakdown.items()) fmt::print(out, "  {:<20} {:>9.2f}\n", name, gib(bytes));
    fmt::print(out, "  {:<20} {:>9.2f}   (peak at {})\n\n", "total", gib(r.breakdown.total()),
               est::to_string(r.breakdown.peak_phase));

    fmt::print(out, "{}\n", r.recommend ? "GPUs that fit, cheapest first (CUDA estimate):"
                                        : "Fit per GPU (CUDA estimate):");
    if (r.gpus.empty()) fmt::print(out, "  none of the catalog GPUs fits this setup\n");
    else
      fmt::print(out, "  {:<10} {:>10} {:>5} {:>13} {:>16} {:>7}\n", "GPU", "memory GiB", "fits", "headroom GiB",
                 "max micro-batch", "$/h");
    for (const auto& f : r.gpus) {
      const std::string max_b = params_only(r) ? std::string("-") : fmt::format("{}", f.max_micro_batch);
      fmt::print(out, "  {:<10} {:>10.2f} {:>5} {:>13.2f} {:>16} {:>7.2f}\n", f.gpu->name, gib(f.gpu->memory_bytes),
                 f.fits ? "yes" : "no", gib(f.gpu->memory_bytes - f.at_requested.total()), max_b,
                 f.gpu->spot_price_usd_per_hour);
    }
    for (const auto& n : r.notes) fmt::print(out, "note: {}\n", est::printable(n));
  }
}

json runs_json(const std::vector<Run>& runs) {
  json list = json::array();
  for (const Run& r : runs) {
    json breakdown = json::object();
    for (const auto& [name, bytes] : r.breakdown.items()) breakdown[name] = bytes;
    breakdown["total"] = r.breakdown.total();
    breakdown["peak_phase"] = std::string(est::to_string(r.breakdown.peak_phase));
    json gpus = json::array();
    for (const auto& f : r.gpus) {
      gpus.push_back({{"name", f.gpu->name},
                      {"memory_bytes", f.gpu->memory_bytes},
                      {"fits", f.fits},
                      {"total_bytes", f.at_requested.total()},
                      {"headroom_bytes", f.gpu->memory_bytes - f.at_requested.total()},
                      {"max_micro_batch", params_only(r) ? json(nullptr) : json(f.max_micro_batch)},
                      {"spot_price_usd_per_hour", f.gpu->spot_price_usd_per_hour}});
    }
    list.push_back({{"label", r.label},
                    {"model", model_json(r.model, r.setup)},
                    {"setup", setup_json(r.setup)},
                    {"device", r.device},
                    {"breakdown", breakdown},
                    {"recommend", r.recommend},
                    {"gpus", gpus},
                    {"notes", r.notes}});
  }
  return {{"runs", list}};
}

void print_gpus(std::ostream& out) {
  fmt::print(out, "{:<10} {:>10} {:>15} {:>12} {:>11}\n", "GPU", "memory GiB", "bandwidth GB/s", "bf16 TFLOPS",
             "spot $/h");
  for (const auto& g : est::gpu_catalog())
    fmt::print(out, "{:<10} {:>10.2f} {:>15.0f} {:>12.0f} {:>11.2f}\n", g.name, gib(g.memory_bytes),
               g.bandwidth_gb_s, g.bf16_tflops, g.spot_price_usd_per_hour);
}

json gpus_json() {
  json list = json::array();
  for (const auto& g : est::gpu_catalog())
    list.push_back({{"name", g.name},
                    {"memory_bytes", g.memory_bytes},
                    {"bandwidth_gb_s", g.bandwidth_gb_s},
                    {"bf16_tflops", g.bf16_tflops},
                    {"spot_price_usd_per_hour", g.spot_price_usd_per_hour}});
  return {{"gpus", list}};
}

void print_presets(std::ostream& out) {
  fmt::print(out, "{:<12} {:>15}  {}\n", "preset", "parameters", "architecture");
  for (const auto& name : est::preset_names()) {
    const est::ModelSpec m = est::preset(name);
    fmt::print(out, "{:<12} {:>15}  {} layers, hidden {}, {} heads ({} kv), vocab {}\n", name,
               est::parameter_count(m), m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.vocab_size);
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
