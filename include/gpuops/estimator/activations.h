#pragma once
// What autograd holds at the end of the forward of one micro-batch: every tensor saved for backward,
// term by term as measured on Hugging Face models (bench/estimator_validation/FINDINGS.md). All of this
// arithmetic lives in src/estimator/activations.cpp so that it can be recalibrated in one place.

#include <cstdint>

#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// Bytes saved by the forward of one micro-batch, by where they live.
struct ForwardSaved {
  int64_t inputs = 0;           ///< token ids (the labels are the same tensor)
  int64_t layers = 0;           ///< every block after checkpointing (a checkpointed block: its input)
  int64_t extras = 0;           ///< autocast's 16-bit weight copies, positions / RoPE tables, shared masks
  int64_t final_norm = 0;       ///< the norm before the LM head (and BERT's MLM transform)
  int64_t loss = 0;             ///< fp32 log-softmax of the logits, shifted labels, the loss value
  int64_t block_attention = 0;  ///< one block's attention half, fully saved (what recomputation rebuilds)
  int64_t block_mlp = 0;        ///< one block's MLP half, fully saved
  int64_t block_other = 0;      ///< the rest of one block: norms, LoRA adapters, residual dropout
  bool last_block_checkpointed = false;  ///< backward starts by recomputing the last block
  int64_t last_block_cache = 0;  ///< selective checkpointing: the last block's kept outputs (popped on recompute)
  int64_t total() const { return (CheckedInt(inputs) + layers + extras + final_norm + loss).get(); }
};

/// Saved bytes of the forward for `setup` (arguments are assumed validated).
ForwardSaved forward_saved(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

/// Bytes of one element of the residual stream and the norms' inputs: 2 when the model runs in 16 bits (or a
/// 16-bit LoRA base under mixed precision), else 4.
int64_t residual_stream_bytes(const TrainingSetup& setup);

/// Transient bytes of one block's attention backward: score gradients (eager, or the CPU's math SDPA
/// with dropout) or the q/k/v gradients of a flash kernel.
int64_t attention_backward_bytes(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

/// Input gradients the backward of the last block's dense MLP adds to its saved tensors at its peak: 2 x tokens x
/// intermediate (a gated MLP: the down projection's input gradient, which frees the input it saved, then the
/// activation's and the up projection's; GPT-2's composite GELU: its intermediates' gradients, measured); 0 for
/// a mixture of experts, whose routed backward is not modelled.
int64_t mlp_backward_bytes(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

}  // namespace gpuops::estimator
