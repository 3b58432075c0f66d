#pragma once
// The transient side of the estimate: activations saved for backward, logits and temporaries. All of
// this arithmetic lives in src/estimator/activations.cpp, behind activation_bytes(), so that it can be
// recalibrated against measured peaks in one place.

#include <cstdint>

#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// Transient bytes of one training step on one GPU.
struct ActivationBytes {
  int64_t activations = 0;  ///< saved for backward, all layers, after checkpointing
  int64_t logits = 0;       ///< logits, fp32 loss copy and the loss gradient
  int64_t temporaries = 0;  ///< beyond activations + logits, at the worse of backward and optimizer step
};

/// Activations, logits and temporaries for `setup` (arguments are assumed validated).
ActivationBytes activation_bytes(const ModelSpec& model, const TrainingSetup& setup);

}  // namespace gpuops::estimator
