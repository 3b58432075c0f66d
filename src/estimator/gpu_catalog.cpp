#include "gpuops/estimator/gpu_catalog.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/estimate.h"

namespace gpuops::estimator {
namespace {

constexpr int64_t MiB = int64_t{1} << 20;

// Letters and digits only, lower case: "A100 80GB", "a100-80gb" and "A100_80GB" all match.
std::string key_of(std::string_view name) {
  std::string k;
  for (unsigned char c : name)
    if (std::isalnum(c)) k.push_back(static_cast<char>(std::tolower(c)));
  return k;
}

}  // namespace

const std::vector<GpuModel>& gpu_catalog() {
  // Memory: the total nvidia-smi reports for each board. Bandwidth and dense bf16 tensor TFLOPS: NVIDIA
  // datasheets (SXM parts for A100/H100/H200). Prices: typical 2026 spot prices per GPU-hour; T4, L4,
  // A10G, A100 40GB and H100 follow ../shared/seeds (GPU selection table), the others are typical market
  // rates. Prices move: treat them as a ranking aid, not a quote.
  static const std::vector<GpuModel> catalog = {
      {"T4", 15360 * MiB, 320, 65, 0.12},            // no bf16 on Turing: the fp16 tensor rate
      {"L4", 23034 * MiB, 300, 121, 0.25},
      {"A10G", 23028 * MiB, 600, 70, 0.50},          // AWS A10 variant, lower clocks than A10's 125
      {"RTX-3090", 24576 * MiB, 936, 71, 0.20},
      {"RTX-4090", 24564 * MiB, 1008, 165, 0.35},
      {"A100-40GB", 40960 * MiB, 1555, 312, 1.10},
      {"A100-80GB", 81920 * MiB, 2039, 312, 1.50},
      {"H100-80GB", 81559 * MiB, 3350, 989, 2.50},
      {"H200", 143771 * MiB, 4800, 989, 3.50},
  };
  return catalog;
}

const GpuModel& find_gpu(std::string_view name) {
  const std::string key = key_of(name);
  std::vector<std::string_view> names;
  for (const auto& g : gpu_catalog()) {
    if (!key.empty() && key_of(g.name) == key) return g;
    names.push_back(g.name);
  }
  throw ArgumentError(fmt::format("gpu '{}' is not in the catalog; accepted: {}", name, fmt::join(names, ", ")));
}

int64_t max_micro_batch(const ModelSpec& model, const TrainingSetup& setup, int64_t memory_bytes) {
  const DeviceProfile cuda = cuda_device();
  TrainingSetup s = setup;
  auto fits = [&](int64_t b) {
    s.micro_batch = b;
    try {
      return estimate_memory(model, s, cuda).total() <= memory_bytes;
    } catch (const SizeOverflow&) {  // more than 2^63 bytes: fits in no memory
      return false;
    }
  };
  if (!fits(1)) return 0;
  // Memory grows monotonically with the micro-batch: double until it fails, then bisect.
  int64_t lo = 1, hi = 2;
  while (hi <= kMaxMicroBatch && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  if (hi > kMaxMicroBatch) {
    if (fits(kMaxMicroBatch)) return kMaxMicroBatch;
    hi = kMaxMicroBatch;
  }
  while (hi - lo > 1) {  // invariant: lo fits, hi does not
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

std::vector<GpuFit> fit_catalog(const ModelSpec& model, const TrainingSetup& setup) {
  const MemoryBreakdown requested = estimate_memory(model, setup, cuda_device());  // validates once
  std::vector<GpuFit> fits;
  for (const auto& g : gpu_catalog()) {
    GpuFit f;
    f.gpu = &g;
    f.at_requested = requested;
    f.fits = requested.total() <= g.memory_bytes;
    f.max_micro_batch = max_micro_batch(model, setup, g.memory_bytes);
    fits.push_back(f);
  }
  return fits;
}

std::vector<GpuFit> recommend(const ModelSpec& model, const TrainingSetup& setup) {
  std::vector<GpuFit> out;
  for (const auto& f : fit_catalog(model, setup))
    if (f.fits) out.push_back(f);
  std::stable_sort(out.begin(), out.end(), [](const GpuFit& a, const GpuFit& b) {
    if (a.gpu->spot_price_usd_per_hour != b.gpu->spot_price_usd_per_hour)
      return a.gpu->spot_price_usd_per_hour < b.gpu->spot_price_usd_per_hour;
    return a.gpu->memory_bytes < b.gpu->memory_bytes;
  });
  return out;
}

}  // namespace gpuops::estimator
