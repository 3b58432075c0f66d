#pragma once
// The random-number state of the process: the CPU generator and every CUDA device's (used by checkpoint
// recomputation and by TrainingState). Internal header.

#include <mutex>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>

#ifdef GPUOPS_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace gpuops::detail {

struct RngState {
  at::Tensor cpu;
  std::vector<at::Tensor> cuda;  ///< per device, empty without CUDA

  static RngState capture() {
    RngState s;
    s.cpu = get(at::detail::getDefaultCPUGenerator());
#ifdef GPUOPS_WITH_CUDA
    if (at::globalContext().hasCUDA()) {
      for (int d = 0; d < at::cuda::device_count(); ++d)
        s.cuda.push_back(get(at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(d))));
    }
#endif
    return s;
  }

  /// Sets the generators back; CUDA states beyond the devices present are ignored.
  void restore() const {
    set(at::detail::getDefaultCPUGenerator(), cpu);
#ifdef GPUOPS_WITH_CUDA
    const size_t devices = at::globalContext().hasCUDA() ? static_cast<size_t>(at::cuda::device_count()) : 0;
    for (size_t d = 0; d < cuda.size() && d < devices; ++d)
      set(at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(d)), cuda[d]);
#endif
  }

 private:
  static at::Tensor get(at::Generator generator) {  // a handle that shares the default generator
    std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }
  static void set(at::Generator generator, const at::Tensor& state) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
};

/// Puts the generators back as they were at its construction when it goes out of scope, also when an
/// exception unwinds (a failed recomputation must not leave the replayed RNG state behind).
class RngStateGuard {
 public:
  RngStateGuard() : saved_(RngState::capture()) {}
  ~RngStateGuard() {
    try {
      saved_.restore();
    } catch (...) {  // a destructor must not throw; set_state of a state it returned does not fail
    }
  }
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  RngState saved_;
};

}  // namespace gpuops::detail
