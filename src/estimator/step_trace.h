#pragma once
// The allocation trace of training steps on a CUDA device, replayed through CachingAllocatorModel to find
// what the caching allocator reserves beyond what the tensors occupy (private to src/estimator).

#include <cstdint>

#include "gpuops/estimator/caching_allocator_model.h"
#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// Peaks of the replayed steady-state step (the second of two: the first creates the optimizer state).
struct AllocatorPeaks {
  int64_t requested = 0;  ///< peak bytes the live tensors asked for
  int64_t allocated = 0;  ///< peak bytes of the blocks handed out (max_memory_allocated)
  int64_t reserved = 0;   ///< peak bytes held in segments (max_memory_reserved)
};

/// Replays two steps of `setup` built from the same terms as the analytic phases (`persistent` is
/// persistent_memory's result) with the allocator rules of `mode`.
AllocatorPeaks replay_training_steps(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device,
                                     const MemoryBreakdown& persistent, AllocatorMode mode);

}  // namespace gpuops::estimator
