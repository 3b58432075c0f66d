#pragma once
// The estimator's one result type: bytes per category at the peak of a training step.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpuops/estimator/checked_int.h"

namespace gpuops::estimator {

/// The moments of a training step whose live bytes compete for the peak (see docs/estimator.md).
enum class StepPhase {
  LossBackward,       ///< backward at the loss: all activations plus the fp32 logit gradients
  AttentionBackward,  ///< backward through the last block's attention: its score/q/k/v gradients
  BackwardEnd,        ///< all gradients, and a tied embedding's second gradient being accumulated
  OptimizerStep,      ///< gradients, states and the optimizer's own temporaries
};

inline std::string_view to_string(StepPhase p) {
  switch (p) {
    case StepPhase::LossBackward: return "loss-backward";
    case StepPhase::AttentionBackward: return "attention-backward";
    case StepPhase::BackwardEnd: return "backward-end";
    case StepPhase::OptimizerStep: return "optimizer-step";
  }
  return "?";
}

/// Memory of one training step on one GPU at its peak, by category, in bytes. Three figures (docs/estimator.md,
/// "Three figures"): allocated_peak() is what torch.cuda.max_memory_allocated sees, reserved_peak() the caching
/// allocator's segments (nvidia-smi's share of the process that the allocator holds), total() the device
/// memory the process uses (nvidia-smi): reserved + CUDA context + NCCL buffers. The fit verdict uses
/// total_high(), the top of the uncertainty band.
struct MemoryBreakdown {
  // Allocated through the caching allocator:
  int64_t weights = 0;           ///< trainable weights plus frozen (LoRA base) weights, local shard
  int64_t gradients = 0;
  int64_t master_weights = 0;    ///< fp32 copy of 16-bit trainable weights (mixed precision)
  int64_t optimizer_states = 0;
  int64_t activations = 0;       ///< tensors saved for backward (and the inputs), still alive at the peak
  int64_t logits = 0;            ///< the loss's fp32 log-softmax and the logit gradients
  int64_t temporaries = 0;       ///< transients of the peak phase (gradients in flight, optimizer scratch)
  int64_t workspaces = 0;        ///< cuBLAS/cuBLASLt workspaces torch keeps per handle (through the allocator)
  int64_t block_rounding = 0;    ///< blocks handed out beyond the requests (512-byte rounding, unsplit tails)
  // Reserved by the caching allocator but not allocated at the peak:
  int64_t allocator_slack = 0;   ///< block and segment rounding, fragmentation between phases (simulated)
  // Outside the allocator:
  int64_t cuda_context = 0;      ///< CUDA context, loaded kernels and library handles
  int64_t nccl_buffers = 0;      ///< NCCL communicator buffers (several GPUs)
  // Not on the device at all:
  int64_t host_memory = 0;       ///< host RAM the setup needs (offloaded or paged optimizer state); in no device figure
  // The uncertainty band of total(): [total() - band_below, total() + band_above].
  int64_t band_below = 0;
  int64_t band_above = 0;
  StepPhase peak_phase = StepPhase::OptimizerStep;  ///< the moment these bytes are alive together

  /// torch.cuda.max_memory_allocated at the peak.
  int64_t allocated_peak() const {
    return (CheckedInt(weights) + gradients + master_weights + optimizer_states + activations + logits +
            temporaries + workspaces + block_rounding).get();
  }
  /// torch.cuda.max_memory_reserved at the peak.
  int64_t reserved_peak() const { return (CheckedInt(allocated_peak()) + allocator_slack).get(); }
  /// Device memory in use (what nvidia-smi shows for the process): the figure the fit verdict is about.
  int64_t total() const { return (CheckedInt(reserved_peak()) + cuda_context + nccl_buffers).get(); }
  /// Bottom and top of the uncertainty band of total().
  int64_t total_low() const { return (CheckedInt(total()) - band_below).get(); }
  int64_t total_high() const { return (CheckedInt(total()) + band_above).get(); }

  /// (name, bytes) for every device category in a fixed order, for tables, JSON and plots (sums to total()).
  std::vector<std::pair<std::string, int64_t>> items() const {
    return {{"weights", weights},
            {"gradients", gradients},
            {"master_weights", master_weights},
            {"optimizer_states", optimizer_states},
            {"activations", activations},
            {"logits", logits},
            {"temporaries", temporaries},
            {"workspaces", workspaces},
            {"block_rounding", block_rounding},
            {"allocator_slack", allocator_slack},
            {"cuda_context", cuda_context},
            {"nccl_buffers", nccl_buffers}};
  }
};

}  // namespace gpuops::estimator
