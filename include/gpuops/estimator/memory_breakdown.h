#pragma once
// The estimator's one result type (design §7): bytes per category at the peak of a training step.

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

/// Memory of one training step on one GPU at its peak, by category, in bytes.
struct MemoryBreakdown {
  int64_t weights = 0;           ///< trainable weights plus frozen (LoRA base) weights, local shard
  int64_t gradients = 0;
  int64_t master_weights = 0;    ///< fp32 copy of 16-bit trainable weights (mixed precision)
  int64_t optimizer_states = 0;
  int64_t activations = 0;       ///< tensors saved for backward (and the inputs), still alive at the peak
  int64_t logits = 0;            ///< the loss's fp32 log-softmax and the logit gradients
  int64_t temporaries = 0;       ///< transients of the peak phase (gradients in flight, optimizer scratch)
  int64_t cuda_context = 0;      ///< CUDA context, kernels and library handles (not allocator memory)
  int64_t allocator_slack = 0;   ///< caching-allocator fragmentation
  StepPhase peak_phase = StepPhase::OptimizerStep;  ///< the moment these bytes are alive together

  /// Sum of every category.
  int64_t total() const {
    return (CheckedInt(weights) + gradients + master_weights + optimizer_states + activations + logits +
            temporaries + cuda_context + allocator_slack).get();
  }

  /// (name, bytes) for every category in a fixed order, for tables and JSON.
  std::vector<std::pair<std::string, int64_t>> items() const {
    return {{"weights", weights},
            {"gradients", gradients},
            {"master_weights", master_weights},
            {"optimizer_states", optimizer_states},
            {"activations", activations},
            {"logits", logits},
            {"temporaries", temporaries},
            {"cuda_context", cuda_context},
            {"allocator_slack", allocator_slack}};
  }
};

}  // namespace gpuops::estimator
