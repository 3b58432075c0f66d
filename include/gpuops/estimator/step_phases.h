#pragma once
// The four moments of a training step that compete for the peak, each as a breakdown of what is alive.

#include <vector>

#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/memory_breakdown.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops::estimator {

/// Bytes the optimizer allocates for itself during its step (for-loop: two tensors the size of the
/// largest parameter; foreach: one list the size of all local parameters; fused kernels: none).
int64_t optimizer_step_temporaries(const ModelSpec& model, const TrainingSetup& setup, const DeviceProfile& device);

/// Elements per rank gpuops' ZeroOptimizer converts to fp32 at once when it reduces a 16-bit bucket (the
/// estimator is torch-free: a copy of gpuops::optim::ZeroShards::kReduceChunk, checked equal by a test).
inline constexpr int64_t kZeroReduceChunk = int64_t{1} << 22;

/// The logits the training loop keeps alive (TrainingSetup::held_logits), counted at every moment. (Its unit,
/// src/estimator/features/held_logits.cpp)
int64_t held_logits_bytes(const ModelSpec& model, const TrainingSetup& setup);

/// One breakdown per StepPhase, in enum order, built on `persistent` (see persistent_memory); without the
/// CUDA context and allocator slack, which estimate_memory adds.
std::vector<MemoryBreakdown> phase_breakdowns(const ModelSpec& model, const TrainingSetup& setup,
                                              const DeviceProfile& device, const MemoryBreakdown& persistent);

}  // namespace gpuops::estimator
