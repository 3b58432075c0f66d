// What CUDA itself takes on the device beside the tensors: the context (driver state, the kernels the
// process loads, library handles), the cuBLAS/cuBLASLt workspaces torch allocates, NCCL's buffers. Each
// figure and its range is cited in docs/estimator.md ("CUDA context, workspaces, NCCL").
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "gpuops/errors.h"
#include "gpuops/estimator/device_profile.h"

namespace gpuops::estimator {
namespace {

constexpr int64_t MiB = int64_t{1} << 20;

struct ContextRange {
  int64_t low, typical, high;  // MiB
};

// nvidia-smi's figure for a torch process minus what its caching allocator reserved, as measured by
// others (docs/estimator.md cites each): with lazy loading only the kernels used are loaded, 256-450 MiB
// on Ampere/Ada boards (RTX 3090: 256, RTX 6000 Ada: 426); no public figure was found for the data-centre
// parts, whose context and per-SM state are larger: 300-700 MiB until a GPU run measures them. Without
// lazy loading (CUDA < 11.7, torch < 1.13 or CUDA_MODULE_LOADING=EAGER) every kernel image is loaded at start.
ContextRange context_mib(int cc, bool lazy, bool consumer) {
  if (!lazy) return {600, 1000, 1100};
  if (!consumer || cc >= 90 || cc < 80) return {300, 500, 700};
  return {256, 400, 450};
}

// Profiles measured by the GPU runs (bench/results/device-profile-*.json; test_estimator_profiles checks each
// entry against its file). They set the workspaces for the same compute capability and CUDA major, and with lazy
// loading (what the runs used) the typical context; the range keeps the table's, widened to the measured one,
// since other drivers and boards of that generation were not measured.
struct BuiltinProfile {
  int cuda_major;
  MeasuredCuda figures;
};
const std::vector<BuiltinProfile>& builtin_profiles() {
  static const std::vector<BuiltinProfile> profiles = {
      {13, {90, 809041920, 783876096, 813236224, 68157440,
            "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, 2026-11-27 (bench/results/device-profile-h200.json)"}},
  };
  return profiles;
}

}  // namespace

std::optional<MeasuredCuda> builtin_measured_cuda(int cc, int cuda_major) {
  for (const BuiltinProfile& p : builtin_profiles())
    if (p.figures.compute_capability == cc && p.cuda_major == cuda_major) return p.figures;
  return std::nullopt;
}

DeviceProfile cuda_device(int cc, const CudaRuntime& runtime, bool nvlink, bool consumer) {
  GPUOPS_CHECK_ARG(cc >= 50 && cc <= 130, "compute capability {} is not accepted; accepted: 50 to 130 (e.g. 90 "
                   "for sm_90)", cc);
  GPUOPS_CHECK_ARG(runtime.cuda_major >= 11 && runtime.cuda_major <= 13,
                   "cuda version {} is not accepted; accepted: 11, 12, 13", runtime.cuda_major);
  GPUOPS_CHECK_ARG(runtime.allocator == AllocatorMode::Default || runtime.allocator == AllocatorMode::ExpandableSegments,
                   "allocator mode {} is not an AllocatorMode; accepted: Default, ExpandableSegments",
                   static_cast<int>(runtime.allocator));
  GPUOPS_CHECK_ARG(runtime.context_bytes >= -1, "context bytes {} is not accepted; accepted: >= 0 (or -1: the "
                   "table's figure)", runtime.context_bytes);
  DeviceProfile d;
  d.kind = DeviceProfile::Cuda;
  d.compute_capability = cc;
  d.nvlink = nvlink;
  d.consumer = consumer;
  d.runtime = runtime;
  // Lazy loading exists from CUDA 11.7; torch turns it on by default.
  const bool lazy = runtime.lazy_loading;
  const MeasuredCuda* measured =
      runtime.measured && runtime.measured->compute_capability == cc ? &*runtime.measured : nullptr;
  const std::optional<MeasuredCuda> builtin = builtin_measured_cuda(cc, runtime.cuda_major);
  if (runtime.context_bytes >= 0) {
    d.cuda_context_bytes = d.cuda_context_low = d.cuda_context_high = runtime.context_bytes;
    d.context_basis = "given with --context-bytes";
  } else if (measured) {
    d.cuda_context_bytes = measured->context_bytes;
    d.cuda_context_low = measured->context_low;
    d.cuda_context_high = measured->context_high;
    d.context_basis = fmt::format("CUDA context measured on {}: {} MiB (range {}-{})", measured->source,
                                  measured->context_bytes / MiB, measured->context_low / MiB,
                                  measured->context_high / MiB);
  } else if (builtin && lazy) {  // the run measured lazy loading's context; its workspaces hold either way
    const ContextRange r = context_mib(cc, lazy, consumer);
    d.cuda_context_bytes = builtin->context_bytes;
    d.cuda_context_low = std::min(r.low * MiB, builtin->context_low);
    d.cuda_context_high = std::max(r.high * MiB, builtin->context_high);
    d.context_basis = fmt::format("CUDA {} context on sm_{} measured on {}: {} MiB (range {}-{}: the measured "
                                  "range and the table's for other drivers)", runtime.cuda_major, cc, builtin->source,
                                  builtin->context_bytes / MiB, d.cuda_context_low / MiB, d.cuda_context_high / MiB);
  } else {
    const ContextRange r = context_mib(cc, lazy, consumer);
    d.cuda_context_bytes = r.typical * MiB;
    d.cuda_context_low = r.low * MiB;
    d.cuda_context_high = r.high * MiB;
    d.context_basis = fmt::format("CUDA {} context on sm_{}, {} module loading: {} MiB (range {}-{})",
                                  runtime.cuda_major, cc, lazy ? "lazy" : "eager", r.typical, r.low, r.high);
  }
  // torch 2.11 allocates one cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG's default: 32 MiB on sm_90, 8 MiB
  // + 128 KiB elsewhere) and one 1 MiB cuBLASLt workspace per (handle, stream) through the caching
  // allocator; a step uses two handles: the forward's thread and the autograd engine's device thread.
  if (measured) {
    d.workspace_bytes = measured->workspace_bytes;
  } else if (builtin) {
    d.workspace_bytes = builtin->workspace_bytes;
  } else {
    d.workspace_bytes = 2 * ((cc == 90 ? 32 * MiB : 8 * MiB + 128 * 1024) + MiB);
  }
  return d;
}

DeviceProfile cpu_device() { return DeviceProfile{}; }

int64_t nccl_buffer_bytes(int64_t num_gpus, bool nvlink) {
  if (num_gpus <= 1) return 0;
  // Measured per GPU for an all-reduce communicator (docs/estimator.md cites them): over NVLink 2 GPUs
  // 544 MB, 4 GPUs 688 MB, 8 GPUs (H100) 1.06 GB: each connection holds LL (512 KiB), LL128 (4.7 MiB)
  // and Simple (4 MiB) buffers per channel, and NVLink nodes open 24 or more channels. PCIe boards use 2
  // channels: 100-250 MiB.
  if (!nvlink) return 175 * MiB;
  if (num_gpus <= 2) return 519 * MiB;
  if (num_gpus <= 4) return 656 * MiB;
  return 1011 * MiB;
}

}  // namespace gpuops::estimator
