#pragma once
// "What do I change to fit on this GPU?": the setup with one change (or two) of the usual memory levers,
// each estimated on the GPU's CUDA profile (device_of) and judged with fits_on (gpu_catalog.h), least invasive first.

#include <cstdint>
#include <string>
#include <vector>

#include "gpuops/estimator/gpu_catalog.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// One alternative setup.
struct Advice {
  std::string description;  ///< the change in words, e.g. "checkpoint every 4th block"
  std::string options;      ///< the same as `gpuops estimate` options, e.g. "--checkpointing every:4"
  int changes = 1;          ///< 1, or 2 for a combination
  bool keeps_numerics = true;  ///< false for LoRA, quantised bases and the 8-bit optimizer
  TrainingSetup setup;      ///< the modified setup
  MemoryBreakdown breakdown;  ///< estimate_memory(model, setup, device_of(gpu, runtime))
  bool fits = false;        ///< fits_on(breakdown, gpu)
};

/// Alternatives to `setup` on `gpu` (its CUDA profile under `runtime`), each lowering the estimate: the fused optimizer, flash attention,
/// activation checkpointing (the sparsest every:K that fits, else full), a smaller micro-batch with more
/// accumulation (same global batch), the lowest ZeRO stage that fits (num_gpus > 1), the 8-bit optimizer,
/// LoRA rank 16 on q,k,v,o with a bf16 base, and with an nf4 base (QLoRA). Pairs of them are added when no
/// single change fits. Order: the ones that fit first; then single changes before pairs; then least
/// invasive first (the order above: numerics-preserving levers before LoRA and quantisation).
/// Validates the setup (ArgumentError).
std::vector<Advice> advise(const ModelSpec& model, const TrainingSetup& setup, const GpuModel& gpu,
                           const CudaRuntime& runtime = CudaRuntime{});

}  // namespace gpuops::estimator
