#pragma once
// The analytic engine: peak memory of one training step from an architecture and a training setup.
// Conventions (also in docs/estimator.md, "Analytic model"):
//  - fp16-mixed / bf16-mixed: 16-bit weights and gradients + fp32 master + fp32 optimizer states (the
//    ZeRO/Megatron/gpuops layout). torch autocast instead keeps fp32 weights and fp32 gradients and no
//    master copy: for Adam the same 16 bytes/parameter, placed differently.
//  - bf16 (pure): bf16 weights, gradients and optimizer states (torch optimizers allocate states like the
//    parameter), no master copy.
//  - ZeRO stage 1 divides optimizer states and master weights by num_gpus, stage 2 also gradients,
//    stage 3 also weights (ceil division; stage > 0 with one GPU saves nothing).
//  - Gradients are counted as resident for the whole step (gpuops keeps flat gradient buffers, and
//    accumulation keeps them anyway).

#include <cstdint>

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// Where the step runs: CUDA adds the context and the caching allocator's slack; the CPU adds neither.
struct DeviceProfile {
  enum Kind { Cpu, Cuda };
  Kind kind = Cpu;
  int64_t cuda_context_bytes = 0;       ///< memory the CUDA context takes outside the allocator
  double allocator_slack_fraction = 0;  ///< of the transient bytes (activations, logits, temporaries)
};

/// A CUDA GPU: 512 MiB context, 10% slack on transient memory (see estimate.cpp for why).
DeviceProfile cuda_device();

/// The CPU: no context, no slack (the counting allocator of MemoryBudget sees exact bytes).
DeviceProfile cpu_device();

/// Trainable parameters of the LoRA adapters: num_layers x sum over targets of rank x (in + out).
int64_t lora_parameter_count(const ModelSpec& model, const LoraSetup& lora);

/// Parameters that get gradients and optimizer states: all of them, or only the adapters with LoRA.
int64_t trainable_parameter_count(const ModelSpec& model, const TrainingSetup& setup);

/// Bytes of the frozen base weights of a LoRA fine-tune in setup.lora.base (0 without LoRA), unsharded.
int64_t frozen_weight_bytes(const ModelSpec& model, const TrainingSetup& setup);

/// `count` divided (ceil) by num_gpus when setup.zero_stage >= from_stage, else `count` itself.
int64_t zero_shard(int64_t count, const TrainingSetup& setup, int from_stage);

/// Peak memory of one training step on one GPU. Validates both arguments (ArgumentError).
MemoryBreakdown estimate_memory(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

}  // namespace gpuops::estimator
