#include "gpuops/estimator/gpu_catalog.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/printable.h"
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
  // Memory: the total nvidia-smi reports for each board. Bandwidth and dense 16-bit tensor TFLOPS: NVIDIA
  // datasheets (SXM parts for A100/H100/H200). Compute capability: NVIDIA's CUDA GPUs list
  // (developer.nvidia.com/cuda-gpus). Prices: typical 2026 spot prices per GPU-hour; T4, L4, A10G, A100
  // 40GB and H100 follow the GPU selection table the project started from, the others are typical market rates.
  // Prices move: treat them as a ranking aid, not a quote.
  //   name  memory  GB/s  TFLOPS  $/h  cc  nvlink  consumer
  static const std::vector<GpuModel> catalog = {
      {"T4", 15360 * MiB, 320, 65, 0.12, 75, false, false},          // Turing: fp16 tensor cores, no bf16
      {"L4", 23034 * MiB, 300, 121, 0.25, 89, false, false},
      {"A10G", 23028 * MiB, 600, 70, 0.50, 86, false, false},        // AWS A10 variant, lower clocks than A10's 125
      {"RTX-3090", 24576 * MiB, 936, 71, 0.20, 86, false, true},
      {"RTX-4090", 24564 * MiB, 1008, 165, 0.35, 89, false, true},
      {"A100-40GB", 40960 * MiB, 1555, 312, 1.10, 80, true, false},
      {"L40S", 46068 * MiB, 864, 362, 0.85, 89, false, false},
      {"A100-80GB", 81920 * MiB, 2039, 312, 1.50, 80, true, false},
      {"H100-80GB", 81559 * MiB, 3350, 989, 2.50, 90, true, false},
      {"H200", 143771 * MiB, 4800, 989, 3.50, 90, true, false},
  };
  return catalog;
}

bool supports_bf16(int cc) { return cc >= 80; }
bool supports_fp8(int cc) { return cc >= 89; }

std::string precisions_of(int cc) {
  std::string out = "fp16";
  if (supports_bf16(cc)) out += ", bf16";
  if (supports_fp8(cc)) out += ", fp8";
  return out;
}

bool runs_precision(const GpuModel& gpu, Precision precision) {
  const bool bf16 = precision == Precision::Bf16Mixed || precision == Precision::Bf16Pure;
  return !bf16 || supports_bf16(gpu.compute_capability);
}

DeviceProfile device_of(const GpuModel& gpu, const CudaRuntime& runtime) {
  return cuda_device(gpu.compute_capability, runtime, gpu.nvlink, gpu.consumer);
}

const GpuModel& find_gpu(std::string_view name) {
  const std::string key = key_of(name);
  std::vector<std::string_view> names;
  for (const auto& g : gpu_catalog()) {
    if (!key.empty() && key_of(g.name) == key) return g;
    names.push_back(g.name);
  }
  throw ArgumentError(
      fmt::format("gpu '{}' is not in the catalog; accepted: {}", printable(name), fmt::join(names, ", ")));
}

// The top of the uncertainty band must fit: an under-estimate is the costly mistake (an OOM after paying).
bool fits_on(const MemoryBreakdown& b, const GpuModel& gpu) { return b.total_high() <= gpu.memory_bytes; }

namespace {

// Largest micro-batch for which fits_at(b) holds; 0 if 1 does not. Memory grows with the micro-batch:
// double until it fails, then bisect.
template <typename F>
int64_t largest_fitting(F fits_at) {
  auto fits = [&](int64_t b) {
    try {
      return fits_at(b);
    } catch (const SizeOverflow&) {  // more than 2^63 bytes: fits in no memory
      return false;
    }
  };
  if (!fits(1)) return 0;
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

}  // namespace

int64_t max_micro_batch(const ModelSpec& model, const TrainingSetup& setup, const GpuModel& gpu,
                        const CudaRuntime& runtime) {
  const DeviceProfile device = device_of(gpu, runtime);
  TrainingSetup s = setup;
  return largest_fitting([&](int64_t b) {
    s.micro_batch = b;
    return fits_on(estimate_memory(model, s, device), gpu);
  });
}

int64_t max_micro_batch(const ModelSpec& model, const TrainingSetup& setup, int64_t memory_bytes) {
  const DeviceProfile device = cuda_device();
  TrainingSetup s = setup;
  return largest_fitting([&](int64_t b) {
    s.micro_batch = b;
    return estimate_memory(model, s, device).total_high() <= memory_bytes;
  });
}

std::vector<GpuFit> fit_catalog(const ModelSpec& model, const TrainingSetup& setup, const CudaRuntime& runtime) {
  std::vector<GpuFit> fits;
  for (const auto& g : gpu_catalog()) {
    GpuFit f;
    f.gpu = &g;
    f.at_requested = estimate_memory(model, setup, device_of(g, runtime));  // validates
    f.fits = fits_on(f.at_requested, g);
    f.precision_ok = runs_precision(g, setup.precision);
    f.max_micro_batch = max_micro_batch(model, setup, g, runtime);
    fits.push_back(f);
  }
  return fits;
}

std::vector<GpuFit> recommend(const ModelSpec& model, const TrainingSetup& setup, const CudaRuntime& runtime) {
  std::vector<GpuFit> out;
  for (const auto& f : fit_catalog(model, setup, runtime))
    if (f.fits && f.precision_ok) out.push_back(f);
  std::stable_sort(out.begin(), out.end(), [](const GpuFit& a, const GpuFit& b) {
    if (a.gpu->spot_price_usd_per_hour != b.gpu->spot_price_usd_per_hour)
      return a.gpu->spot_price_usd_per_hour < b.gpu->spot_price_usd_per_hour;
    return a.gpu->memory_bytes < b.gpu->memory_bytes;
  });
  return out;
}

}  // namespace gpuops::estimator
