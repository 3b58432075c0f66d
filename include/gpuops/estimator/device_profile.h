#pragma once
// Where the training step runs, as far as memory is concerned. Torch-free.

#include <cstdint>

namespace gpuops::estimator {

/// CUDA adds the context and the caching allocator's slack and uses GPU kernels (flash SDPA with
/// is_causal, 1-byte dropout masks, foreach optimizers); the CPU adds neither and uses torch's CPU kernels
/// (SDPA given a materialised mask, dropout masks in the input dtype, for-loop optimizers).
struct DeviceProfile {
  enum Kind { Cpu, Cuda };
  Kind kind = Cpu;
  int64_t cuda_context_bytes = 0;       ///< memory the CUDA context takes outside the allocator
  double allocator_slack_fraction = 0;  ///< of the transient bytes (activations, logits, temporaries)
  bool is_cpu() const { return kind == Cpu; }
};

/// A CUDA GPU: 512 MiB context, 10% slack on transient memory (see estimate.cpp for why).
DeviceProfile cuda_device();

/// The CPU: no context, no slack (the counting allocator of MemoryBudget sees exact bytes).
DeviceProfile cpu_device();

}  // namespace gpuops::estimator
