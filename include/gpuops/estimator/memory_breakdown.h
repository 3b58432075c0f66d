#pragma once
// The estimator's one result type (design §7): bytes per category at the peak of a training step.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpuops::estimator {

/// Peak memory of one training step on one GPU, by category, in bytes.
struct MemoryBreakdown {
  int64_t weights = 0;           ///< trainable weights plus frozen (LoRA base) weights, local shard
  int64_t gradients = 0;
  int64_t master_weights = 0;    ///< fp32 copy of 16-bit trainable weights (mixed precision)
  int64_t optimizer_states = 0;
  int64_t activations = 0;       ///< tensors saved for backward
  int64_t logits = 0;            ///< LM-head output, its fp32 loss copy and gradient
  int64_t temporaries = 0;       ///< extra transient memory of the worse of backward and optimizer step
  int64_t cuda_context = 0;      ///< CUDA context, kernels and library handles (not allocator memory)
  int64_t allocator_slack = 0;   ///< caching-allocator fragmentation

  /// Sum of every category.
  int64_t total() const {
    return weights + gradients + master_weights + optimizer_states + activations + logits + temporaries +
           cuda_context + allocator_slack;
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
