#pragma once
// How the persistent training state is cut: quantised and 8-bit sizes, each layout's local share and unsharded
// buffers (docs/estimator.md, "Optimizers, offload and sharding"). Torch-free. The terms of each setup feature
// (Adafactor, paged optimizers, offload, FSDP2, ZeRO-3, gpuops' stage 3) live in its unit, src/estimator/features/.

#include <cstdint>
#include <optional>

#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/param_tensors.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// bitsandbytes allocates a paged (unified-memory) state only for tensors of at least this many values.
inline constexpr int64_t kPagedMinElements = 100000;

/// True for the int8 and nf4 (with or without double quantisation) bases.
bool is_quantised_base(BaseWeightDtype dtype);

/// Bytes of one frozen linear weight of in x out values in `dtype` (no bias): 16-bit 2 per value; int8 1 per
/// value + an fp32 scale per row; nf4 0.5 per value + (double quantisation) 1 byte per 64 values and 4 per
/// 16384, or (nf4-nodq) 4 bytes per 64 values.
int64_t quantised_weight_bytes(int64_t in_features, int64_t out_features, BaseWeightDtype dtype);

/// bitsandbytes' block-wise 8-bit Adam states of `n` values: two 1-byte states and one fp32 absmax per
/// 2048-value block each.
int64_t eight_bit_adam_state_bytes(int64_t n);

/// Trainable elements held by one GPU from ZeRO stage `from_stage` on: FSDP2 sums each tensor's padded
/// dim-0 shard; the flat layout divides the total (ceil), see zero_shard.
int64_t sharded_trainable_elements(const ModelSpec& model, const TrainingSetup& setup, int from_stage);

/// Frozen (LoRA base) bytes one GPU holds: FSDP2 per tensor, the flat layout ceil(total / num_gpus) at stage 3.
int64_t sharded_frozen_bytes(const ModelSpec& model, const TrainingSetup& setup);

/// Adafactor's persistent state on one GPU: factored fp32 row and column vectors for >= 2-D tensors, a full
/// fp32 second moment for 1-D ones, and the fp32 'RMS' scalar per tensor. Under ZeRO stage >= 1 (flat
/// fp32 partitions, which Adafactor sees as 1-D) a full second moment of the local partition.
int64_t adafactor_state_bytes(const ModelSpec& model, const TrainingSetup& setup);

/// Unsharded parameters and gradients of a ZeRO-3 layout alive at `phase`, each layout's from its unit
/// (features/zero3_flat.cpp: the gathered weights of the current and the prefetched block in the backward
/// moments; fsdp2.cpp: the same with reshard_after_forward, every block's without, plus the root module's
/// parameters, a block's unsharded gradients in its backward and the root's at its end; gpuops_stage3.cpp:
/// gpuops' units). 0 with one GPU.
int64_t unsharded_bytes(const ModelSpec& model, const TrainingSetup& setup, StepPhase phase);

/// gpuops' stage 3 (sharding gpuops), the moment the LM head's gradient arrives, after the loss moment: unit 0
/// gathered, its whole gradient buffer, and the head's gradient being copied into it. 0 otherwise.
/// (features/gpuops_stage3.cpp)
int64_t gpuops_head_bytes(const ModelSpec& model, const TrainingSetup& setup);

}  // namespace gpuops::estimator
