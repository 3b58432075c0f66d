#pragma once
// GPU models and the question "which of them fit this job, cheapest first" (design §7).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// One GPU model: usable memory and datasheet rates, with a typical spot price.
struct GpuModel {
  std::string name;
  int64_t memory_bytes = 0;             ///< usable: the total nvidia-smi reports (after ECC reservation)
  double bandwidth_gb_s = 0;            ///< datasheet memory bandwidth
  double bf16_tflops = 0;               ///< dense bf16 tensor-core rate (T4: fp16, it has no bf16)
  double spot_price_usd_per_hour = 0;   ///< typical spot price of one GPU
};

/// How `gpu` fits a job.
struct GpuFit {
  const GpuModel* gpu = nullptr;
  bool fits = false;            ///< at the requested micro-batch
  int64_t max_micro_batch = 0;  ///< largest micro-batch that fits (capped at kMaxMicroBatch); 0 if 1 does not
  MemoryBreakdown at_requested; ///< estimate at the requested micro-batch, CUDA profile
};

/// Upper bound of the micro-batch search.
inline constexpr int64_t kMaxMicroBatch = 65536;

/// Every GPU model, smallest memory first.
const std::vector<GpuModel>& gpu_catalog();

/// The GPU called `name`, ignoring case, spaces, '-' and '_'; ArgumentError listing the names otherwise.
const GpuModel& find_gpu(std::string_view name);

/// Largest micro-batch (1..kMaxMicroBatch) whose CUDA estimate fits in `memory_bytes`; 0 if none.
int64_t max_micro_batch(const ModelSpec& model, const TrainingSetup& setup, int64_t memory_bytes);

/// The fit of every catalog GPU, in catalog order.
std::vector<GpuFit> fit_catalog(const ModelSpec& model, const TrainingSetup& setup);

/// The GPUs that fit at the requested micro-batch, cheapest first (ties: less memory first).
std::vector<GpuFit> recommend(const ModelSpec& model, const TrainingSetup& setup);

}  // namespace gpuops::estimator
