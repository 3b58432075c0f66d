#pragma once
// "What do I change to fit on this GPU?": the setup with one change (or two) of the usual memory levers,
// each estimated on the GPU's CUDA profile (device_of) and judged with fits_on (gpu_catalog.h), cheapest first.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator/gpu_catalog.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// What a change costs besides memory, cheapest first: nothing (the same results at the same speed), recomputed
/// activations, a slower step (smaller micro-batches, a host-side optimizer), more communication (a higher ZeRO
/// stage), or other numerics (another optimizer, 16-bit weights, LoRA, a quantised base).
enum class AdviceCost { None, Recompute, Slower, Communication, Numerics };
std::string_view to_string(AdviceCost cost);

/// One alternative setup.
struct Advice {
  std::string description;  ///< the change in words, e.g. "checkpoint every 4th block"
  std::string options;      ///< the same as `gpuops estimate` options, e.g. "--checkpointing every:4"
  int changes = 1;          ///< 1, or 2 or 3 for a combination
  AdviceCost cost = AdviceCost::None;  ///< of a combination: the dearest of its changes
  bool keeps_numerics = true;  ///< cost != Numerics
  int64_t saved_bytes = 0;     ///< the setup as given minus this one (CUDA estimates on the GPU)
  TrainingSetup setup;      ///< the modified setup
  MemoryBreakdown breakdown;  ///< estimate_memory(model, setup, device_of(gpu, runtime))
  bool fits = false;        ///< fits_on(breakdown, gpu)
};

/// Alternatives to `setup` on `gpu` (its CUDA profile under `runtime`), each lowering the estimate, from every
/// lever the estimator models: the fused optimizer, flash attention, a chunked or fused linear cross-entropy,
/// logits not held, gradients set to None, ZeRO reduction in the backward, torch.compile, activation
/// checkpointing (the sparsest every:K that fits, selective, full), a smaller micro-batch with more accumulation
/// (same global batch), optimizer offload, a higher ZeRO stage (num_gpus > 1), the 8-bit, paged 8-bit or
/// Adafactor optimizer, 16-bit weights with an fp32 master, LoRA without dropout, LoRA rank 16 on q,k,v,o with
/// a bf16 or an nf4 base. Pairs are added when no single change fits, triples when no pair fits (of each size:
/// those that fit, else the closest). Order: those that fit first, by cost (AdviceCost), then single changes
/// before combinations, then the most memory saved; then those that do not fit, the smallest shortfall first.
/// Validates the setup (ArgumentError).
std::vector<Advice> advise(const ModelSpec& model, const TrainingSetup& setup, const GpuModel& gpu,
                           const CudaRuntime& runtime = CudaRuntime{});

}  // namespace gpuops::estimator
