#pragma once
// Where the training step runs, as far as memory is concerned. Torch-free.

#include <cstdint>
#include <optional>
#include <string>

#include "gpuops/estimator/caching_allocator_model.h"

namespace gpuops::estimator {

/// CUDA figures measured on one GPU by bench/estimator_validation/calibrate_device.py (a device profile file,
/// `--device-profile`): they replace the table's context and workspaces for GPUs of that compute capability.
struct MeasuredCuda {
  int compute_capability = 0;  ///< of the GPU measured (90 for an H100)
  int64_t context_bytes = 0;   ///< device memory in use minus max_memory_reserved, while training
  int64_t context_low = 0;     ///< its range over the moments measured
  int64_t context_high = 0;
  int64_t workspace_bytes = 0;  ///< cuBLAS/cuBLASLt workspaces a forward and backward keep allocated
  std::string source;           ///< the GPU, driver, torch and date measured, for notes
};

/// The CUDA software a job runs with: what sizes the context and the allocator's behaviour.
struct CudaRuntime {
  int cuda_major = 13;             ///< CUDA major version of the torch build (torch 2.11: 13; 11 and 12 accepted)
  bool lazy_loading = true;        ///< CUDA_MODULE_LOADING=LAZY (torch's default since 1.13 on CUDA >= 11.7)
  AllocatorMode allocator = AllocatorMode::Default;  ///< PYTORCH_CUDA_ALLOC_CONF expandable_segments
  int64_t context_bytes = -1;      ///< >= 0: the measured context to use instead of the table (--context-bytes)
  std::optional<MeasuredCuda> measured;  ///< a device profile (--device-profile); context_bytes >= 0 wins over it
};

/// CUDA adds the context, the library workspaces and the caching allocator's reserve and uses GPU kernels
/// (flash SDPA with is_causal, 1-byte dropout masks, foreach optimizers); the CPU adds none of these and
/// uses torch's CPU kernels (SDPA given a materialised mask, dropout masks in the input dtype, for-loop
/// optimizers).
struct DeviceProfile {
  enum Kind { Cpu, Cuda };
  Kind kind = Cpu;
  int compute_capability = 0;           ///< 10 * major + minor (90 for sm_90); 0 on the CPU
  bool nvlink = false;                  ///< NVLink/SXM part: NCCL opens many channels
  bool consumer = false;                ///< GeForce/workstation board: the measured consumer context range
  CudaRuntime runtime;
  int64_t cuda_context_bytes = 0;       ///< typical context (kernels, handles) outside the allocator
  int64_t cuda_context_low = 0;         ///< its range across the measurements behind the table
  int64_t cuda_context_high = 0;
  int64_t workspace_bytes = 0;          ///< cuBLAS + cuBLASLt workspaces torch allocates per handle and stream
  std::string context_basis;            ///< where the context figure comes from, for notes
  bool is_cpu() const { return kind == Cpu; }
};

/// A CUDA GPU of compute capability `cc` (e.g. 90) under `runtime`, an NVLink part or not, a consumer
/// (GeForce/workstation) board or not: context, workspaces and their ranges from the table in cuda_runtime_costs.cpp
/// (docs/estimator.md cites each figure). The default is an H100 with torch 2.11's CUDA 13.
DeviceProfile cuda_device(int cc = 90, const CudaRuntime& runtime = CudaRuntime{}, bool nvlink = true,
                          bool consumer = false);

/// The profile a GPU run measured for compute capability `cc` under CUDA `cuda_major` with lazy loading, shipped
/// with gpuops (bench/results/device-profile-*.json): cuda_device() uses it in place of the table's typical
/// context and workspaces. None where no run measured that pair.
std::optional<MeasuredCuda> builtin_measured_cuda(int cc, int cuda_major);

/// A device profile file's figures (docs/estimator.md, "Measured device profiles"); errors name `label` (the
/// option or argument that gave the path), the file and the field.
MeasuredCuda read_device_profile(const std::string& path, const std::string& label = "--device-profile");

/// The CPU: no context, no slack (MemoryBudget's counting allocator sees exact bytes).
DeviceProfile cpu_device();

/// NCCL's device buffers per GPU for a data-parallel job over `num_gpus` GPUs (0 for one GPU), over NVLink
/// or PCIe.
int64_t nccl_buffer_bytes(int64_t num_gpus, bool nvlink);

}  // namespace gpuops::estimator
