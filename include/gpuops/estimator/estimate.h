#pragma once
// The analytic engine: peak memory of one training step from an architecture and a training setup.
// The peak is the largest of four moments of the step (StepPhase), each the sum of what is alive then;
// the breakdown is that of the winning moment. Conventions (docs/estimator.md, "Analytic model"):
//  - fp16-mixed / bf16-mixed with amp autocast: fp32 weights, gradients and states, 16-bit weight copies
//    cached per forward; with amp master-copy: 16-bit weights and gradients, fp32 master and states.
//  - bf16 (pure): bf16 weights, gradients and optimizer states, no master copy.
//  - ZeRO stage 1 divides optimizer states and master weights by num_gpus, stage 2 also gradients,
//    stage 3 also weights (ceil division; stage > 0 with one GPU saves nothing).
//  - Gradients are set to None between steps (torch's zero_grad default): the forward and the loss
//    backward of a step run without them, unless grad_accum > 1 keeps them alive.

#include <cstdint>
#include <vector>

#include "gpuops/estimator/activations.h"
#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// Trainable parameters of the LoRA adapters: num_layers x sum over targets of rank x (in + out). (LoRA's unit,
/// src/estimator/features/lora.cpp)
int64_t lora_parameter_count(const ModelSpec& model, const LoraSetup& lora);

/// Parameters that get gradients and optimizer states: all of them, or only the adapters with LoRA.
int64_t trainable_parameter_count(const ModelSpec& model, const TrainingSetup& setup);

/// Bytes of the frozen base weights of a LoRA fine-tune in setup.lora.base (0 without LoRA), unsharded. (LoRA's
/// unit, src/estimator/features/lora.cpp)
int64_t frozen_weight_bytes(const ModelSpec& model, const TrainingSetup& setup);

/// Elements of the largest weight an int8/nf4 base dequantises for one matmul (a block linear, MoE experts included,
/// or the LM head with quantize_lm_head); 0 without a quantised base. (LoRA's unit)
int64_t largest_quantised_weight_elements(const ModelSpec& model, const TrainingSetup& setup);

/// Of frozen_weight_bytes, the quantisation statistics of an int8/nf4 base (nf4's absmax and its double
/// quantisation, int8's row scales): tensors bitsandbytes hangs on the weights, not parameters (0 otherwise).
int64_t quantisation_statistics_bytes(const ModelSpec& model, const TrainingSetup& setup);

/// The band around the allocated bytes, as fractions of them: what a training stack adds or leaves out that its
/// settings do not show (loaders, library versions, unstated defaults), each side the smallest multiple of 5%
/// that puts every fitting row of the published table inside the band. On 2026-11-28 (42 rows,
/// validate_published.py's band_fractions) the largest needs were 0.211 above (hf-perfone-bertlarge-adafactor-fp16-
/// b1-ga4-gc) and 0.081 below (litgpt-tinyllama-lora-a10g); 0.275 above (litgpt-gemma-2b-qlora-a10g) set 30%
/// before LitGPT's float16 dequantisation and held logits were counted. The held-out rows check them
/// (docs/estimator.md, "Fitting and held-out rows"). Where the setup is known exactly the error is far smaller
/// (the CPU grid; 59 cases on an H200 within 0.5% median).
inline constexpr double kAllocatedBandBelow = 0.10;
inline constexpr double kAllocatedBandAbove = 0.25;

/// `count` divided (ceil) by num_gpus when setup.zero_stage >= from_stage, else `count` itself.
int64_t zero_shard(int64_t count, const TrainingSetup& setup, int from_stage);

/// Persistent bytes of a step on one GPU: weights (+ buffers), gradients, master weights, optimizer states.
MemoryBreakdown persistent_memory(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

/// Peak memory of one training step on one GPU. Validates both arguments (ArgumentError).
MemoryBreakdown estimate_memory(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

/// Every moment of the step (one breakdown per StepPhase, in enum order) with the device's terms, as
/// estimate_memory sees them: its result is the largest of these (ties: the earlier). For pictures.
std::vector<MemoryBreakdown> estimate_phases(const ModelSpec& model, const TrainingSetup& setup,
                                             const DeviceProfile& device);

}  // namespace gpuops::estimator
