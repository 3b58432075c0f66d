// Batch-size tuning per GPU model (the built-in model of bench/tune_batch_size.py): for each target memory
// (a catalog GPU emulated with a memory cap on the GPU at hand, or a CPU MemoryBudget when there is no
// GPU), find the largest batch of a GPT-2-style LibTorch model that trains, then measure throughput and
// peak memory along a ladder of batch sizes. Writes one JSON file per target; tune_batch_size.py turns them
// into the Markdown table and the plots in docs/.
//
//   build/py/bench/tune_batch_size --budgets 128MiB,512MiB --out bench/results
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <gpuops/gpuops.h>
#include <gpuops/estimator/device_profile.h>
#include <gpuops/estimator/gpu_catalog.h>

#include "gpt2_lm.h"

namespace {

using json = nlohmann::json;

struct Target {
  std::string name;
  int64_t bytes;
};

int64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  const double value = std::stod(text, &used);
  const std::string unit = text.substr(used);
  const double scale = unit == "GiB" ? 1 << 30 : unit == "MiB" ? 1 << 20 : unit == "KiB" ? 1 << 10 : unit.empty() ? 1 : 0;
  if (scale == 0 || value <= 0) throw CLI::ValidationError("--budgets", "sizes like 256MiB or 2GiB, got " + text);
  return static_cast<int64_t>(value * scale);
}

void progress(const std::string& what, size_t done, size_t total) {
  const int width = 30;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  std::fprintf(stderr, "\r[%s%s] %zu/%zu %-40s", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), done, total, what.c_str());
  std::fflush(stderr);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Find the largest trainable batch and the throughput per batch size, per GPU model or CPU budget"};
  bench::Gpt2Config config;
  std::string budgets, out = "bench/results", precision = "fp32";
  int64_t sequence = 128, timed_steps = 3;
  app.add_option("--budgets", budgets, "CPU memory budgets to emulate, e.g. 128MiB,512MiB (default without a GPU)");
  app.add_option("--out", out, "folder for the JSON results");
  app.add_option("--sequence", sequence, "tokens per sample")->check(CLI::Range(2, 1024));
  app.add_option("--layers", config.layers, "transformer blocks")->check(CLI::Range(1, 96));
  app.add_option("--width", config.width, "hidden size")->check(CLI::Range(16, 8192));
  app.add_option("--heads", config.heads, "attention heads")->check(CLI::Range(1, 128));
  app.add_option("--steps", timed_steps, "timed steps per batch size")->check(CLI::Range(1, 1000));
  app.add_option("--precision", precision, "fp32 or bf16-mixed")->check(CLI::IsMember({"fp32", "bf16-mixed"}));
  CLI11_PARSE(app, argc, argv);
  if (config.width % config.heads != 0) {
    std::fprintf(stderr, "--width (%lld) must be a multiple of --heads (%lld)\n", static_cast<long long>(config.width),
                 static_cast<long long>(config.heads));
    return 2;
  }
  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  std::vector<Target> targets;
  try {
    if (!budgets.empty() || !cuda) {
      std::string list = budgets.empty() ? "128MiB,512MiB" : budgets;
      for (size_t start = 0; start <= list.size();) {
        const size_t comma = std::min(list.find(',', start), list.size());
        const std::string item = list.substr(start, comma - start);
        targets.push_back({(cuda ? "cap-" : "cpu-") + item, parse_bytes(item)});
        start = comma + 1;
      }
    } else {  // each catalog GPU that the GPU at hand can emulate, minus its CUDA context
      const int64_t room = gpuops::memory_headroom_bytes(device);
      for (const auto& gpu : gpuops::estimator::gpu_catalog()) {
        const int64_t usable = gpu.memory_bytes - gpuops::estimator::cuda_device().cuda_context_bytes;
        if (usable <= room) targets.push_back({gpu.name, usable});
      }
    }
  } catch (const CLI::ValidationError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  config.positions = std::max<int64_t>(config.positions, sequence);

  for (size_t t = 0; t < targets.size(); ++t) {
    const Target& target = targets[t];
    torch::manual_seed(0);
    bench::Gpt2LM model(config);
    model->to(device);
    gpuops::optim::AdamW optimizer(model->parameters(), gpuops::optim::AdamWOptions(1e-4));
    const auto dtype = precision == "fp32" ? torch::kFloat : torch::kBFloat16;
    auto step = [&](int64_t batch) {
      optimizer.zero_grad();
      const auto ids = torch::randint(0, config.vocab, {batch, sequence}, torch::TensorOptions(torch::kLong).device(device));
      std::optional<gpuops::amp::AutocastGuard> autocast;
      if (dtype != torch::kFloat) autocast.emplace(device.type(), dtype);
      const auto loss = model->loss(ids);
      autocast.reset();
      loss.backward();
      optimizer.step();
    };
    progress(target.name + ": searching", t, targets.size());
    gpuops::MemoryBudget cap(target.bytes, device);
    gpuops::FindBatchOptions options;
    options.device = device;
    gpuops::BatchSearchResult found;
    try {
      found = gpuops::find_max_batch_size(step, options);
    } catch (const c10::OutOfMemoryError&) {
      std::fprintf(stderr, "\n%s: even batch 1 does not fit in %lld bytes\n", target.name.c_str(),
                   static_cast<long long>(target.bytes));
    }

    json ladder = json::array();
    std::vector<int64_t> sizes;
    for (int64_t b = 1; b < found.max_batch; b *= 2) sizes.push_back(b);
    if (found.max_batch > 0) sizes.push_back(found.max_batch);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t b = sizes[i];
      progress(target.name + ": batch " + std::to_string(b), t, targets.size());
      cap.reset_peak();
      step(b);  // warm-up
      if (cuda) torch::cuda::synchronize();
      const auto start = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < timed_steps; ++s) step(b);
      if (cuda) torch::cuda::synchronize();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / timed_steps;
      ladder.push_back({{"batch", b}, {"samples_per_s", b / seconds}, {"step_seconds", seconds},
                        {"peak_bytes", cap.peak_bytes()}});
    }
    json trials = json::array();
    for (const auto& trial : found.trials)
      trials.push_back({{"batch", trial.batch}, {"ok", trial.ok}, {"peak_bytes", trial.peak_bytes},
                        {"seconds", trial.seconds}, {"phase", trial.phase}});
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    const json result = {
        {"target", target.name}, {"limit_bytes", target.bytes}, {"device", cuda ? "cuda" : "cpu"}, {"date", date},
        {"model", {{"name", "gpt2-style (LibTorch)"}, {"layers", config.layers}, {"width", config.width},
                   {"heads", config.heads}, {"vocab", config.vocab}, {"sequence", sequence},
                   {"precision", precision}, {"optimizer", "gpuops AdamW"}}},
        {"max_batch", found.max_batch}, {"recommended", found.recommended}, {"trials", trials},
        {"throughput", ladder},
        {"caveats", cuda ? "a memory cap cannot emulate another GPU's CUDA context, NCCL buffers, or the kernels "
                           "(and workspaces) cuBLAS/cuDNN pick on another chip"
                         : "a CPU MemoryBudget counts tensor allocations only: no CUDA context, caching-allocator "
                           "fragmentation, workspaces or NCCL buffers; throughput is the CPU's"}};
    std::ofstream(out + "/" + target.name + ".json") << result.dump(1) << "\n";
  }
  progress("done", targets.size(), targets.size());
  std::fprintf(stderr, "\n");
  return 0;
}
