#pragma once
// GPU models and the question "which of them fit this job, cheapest first".

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// One GPU model: usable memory, what its tensor cores compute, datasheet rates and a typical spot price.
struct GpuModel {
  std::string name;
  int64_t memory_bytes = 0;             ///< usable: the total nvidia-smi reports (after ECC reservation)
  double bandwidth_gb_s = 0;            ///< datasheet memory bandwidth
  double tensor_tflops = 0;             ///< dense 16-bit tensor-core rate: bf16, or fp16 where there is no bf16
  double spot_price_usd_per_hour = 0;   ///< typical spot price of one GPU
  int compute_capability = 0;           ///< 10 * major + minor: 75 for sm_75
  bool nvlink = false;                  ///< SXM/NVLink part (NCCL's buffers; data-centre context)
  bool consumer = false;                ///< GeForce/workstation board (its measured context figures)
};

/// Tensor-core precisions of a compute capability: fp16 from sm_70, bf16 from sm_80, fp8 from sm_89.
bool supports_bf16(int compute_capability);
bool supports_fp8(int compute_capability);
/// "fp16", "fp16, bf16" or "fp16, bf16, fp8".
std::string precisions_of(int compute_capability);

/// Whether `gpu` runs `precision` natively: the bf16 ones need bf16 tensor cores (sm_80+). fp16-mixed and
/// fp32 run everywhere.
bool runs_precision(const GpuModel& gpu, Precision precision);

/// The CUDA profile of `gpu` (its compute capability and class) under `runtime`.
DeviceProfile device_of(const GpuModel& gpu, const CudaRuntime& runtime = CudaRuntime{});

/// How `gpu` fits a job.
struct GpuFit {
  const GpuModel* gpu = nullptr;
  bool fits = false;            ///< at the requested micro-batch, by fits_on (the top of the band)
  bool precision_ok = true;     ///< runs_precision: false for a bf16 setup on a card without bf16
  int64_t max_micro_batch = 0;  ///< largest micro-batch that fits (capped at kMaxMicroBatch); 0 if 1 does not
  MemoryBreakdown at_requested; ///< estimate at the requested micro-batch, this GPU's CUDA profile
};

/// Upper bound of the micro-batch search.
inline constexpr int64_t kMaxMicroBatch = 65536;

/// Every GPU model, smallest memory first.
const std::vector<GpuModel>& gpu_catalog();

/// The GPU called `name`, ignoring case, spaces, '-' and '_'; ArgumentError listing the names otherwise.
const GpuModel& find_gpu(std::string_view name);

/// Whether a CUDA estimate `b` fits on `gpu`: the one fit criterion of the catalog, --advise and the plots.
bool fits_on(const MemoryBreakdown& b, const GpuModel& gpu);

/// Largest micro-batch (1..kMaxMicroBatch) whose estimate on `gpu` fits (fits_on); 0 if none.
int64_t max_micro_batch(const ModelSpec& model, const TrainingSetup& setup, const GpuModel& gpu,
                        const CudaRuntime& runtime = CudaRuntime{});
/// The same for a bare memory size on the default CUDA profile (an H100's).
int64_t max_micro_batch(const ModelSpec& model, const TrainingSetup& setup, int64_t memory_bytes);

/// The fit of every catalog GPU, in catalog order, each on its own CUDA profile.
std::vector<GpuFit> fit_catalog(const ModelSpec& model, const TrainingSetup& setup,
                                const CudaRuntime& runtime = CudaRuntime{});

/// The GPUs that fit at the requested micro-batch and run its precision, cheapest first (ties: less memory
/// first).
std::vector<GpuFit> recommend(const ModelSpec& model, const TrainingSetup& setup,
                              const CudaRuntime& runtime = CudaRuntime{});

}  // namespace gpuops::estimator
