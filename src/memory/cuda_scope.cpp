// The CUDA half of MemoryBudget: reads the caching allocator's statistics and caps it with a memory
// fraction so that a large GPU behaves like a smaller one. What a cap cannot emulate: the CUDA context,
// NCCL buffers and the cuBLAS/cuDNN workspace choices of another chip (docs/architecture.md).
#include <algorithm>

#include <c10/util/Exception.h>

#include "memory_scope.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace gpuops::memory {

#ifdef GPUOPS_WITH_CUDA
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

class CudaScope final : public MemoryBudget::Scope {
 public:
  CudaScope(int64_t limit, c10::DeviceIndex device) : limit_(limit), device_(device) {
    alloc::emptyCache();
    const auto stats = alloc::getDeviceStats(device);
    baseline_ = stats.allocated_bytes[kAggregate].current;
    baseline_ooms_ = stats.num_ooms;
    baseline_allocations_ = stats.allocation[kAggregate].allocated;
    alloc::resetPeakStats(device);
    previous_fraction_ = alloc::getMemoryFraction(device);
    if (limit != MemoryBudget::kUnlimited) {
      size_t free_bytes = 0, total_bytes = 0;
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      const double fraction = static_cast<double>(baseline_ + limit) / static_cast<double>(total_bytes);
      alloc::setMemoryFraction(std::min(fraction, previous_fraction_), device);
    }
  }
  ~CudaScope() override {
    if (limit_ != MemoryBudget::kUnlimited) alloc::setMemoryFraction(previous_fraction_, device_);
  }
  MemoryStats stats() const override {
    const auto stats = alloc::getDeviceStats(device_);
    const auto& bytes = stats.allocated_bytes[kAggregate];
    return {bytes.current - baseline_, std::max<int64_t>(0, bytes.peak - baseline_), limit_,
            stats.allocation[kAggregate].allocated - baseline_allocations_, stats.num_ooms - baseline_ooms_};
  }
  void reset_peak() override { alloc::resetPeakStats(device_); }

 private:
  int64_t limit_;
  c10::DeviceIndex device_;
  int64_t baseline_ = 0;
  int64_t baseline_ooms_ = 0;
  int64_t baseline_allocations_ = 0;
  double previous_fraction_ = 1.0;
};

// The ordinal `device` names (its index, else the current device), checked against the visible devices first:
// asking the runtime about a device it does not have raises a raw CUDA error that names no argument.
c10::DeviceIndex visible_index(c10::Device device, const char* where) {
  const int count = c10::cuda::device_count();  // 0, not an error, without a usable driver or device
  TORCH_CHECK_VALUE(count > 0, where, ": device '", device.str(), "' is not available: this process sees no CUDA ",
                    "device (check the driver and CUDA_VISIBLE_DEVICES)");
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK_VALUE(index >= 0 && index < count, where, ": device '", device.str(), "' has index ", index,
                    "; accepted: 0..", count - 1, " (the CUDA devices this process sees)");
  return static_cast<c10::DeviceIndex>(index);
}

}  // namespace

int64_t cuda_headroom_bytes(c10::Device device) {
  const c10::DeviceIndex index = visible_index(device, "memory_headroom_bytes");
  size_t free_bytes = 0, total_bytes = 0;
  {
    c10::cuda::CUDAGuard guard(index);
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  }
  const auto stats = alloc::getDeviceStats(index);
  const int64_t allocated = stats.allocated_bytes[kAggregate].current;
  const int64_t cached_unused = stats.reserved_bytes[kAggregate].current - allocated;
  const auto within_fraction =
      static_cast<int64_t>(alloc::getMemoryFraction(index) * static_cast<double>(total_bytes)) - allocated;
  return std::max<int64_t>(0, std::min(static_cast<int64_t>(free_bytes) + cached_unused, within_fraction));
}

std::unique_ptr<MemoryBudget::Scope> make_cuda_scope(int64_t limit_bytes, c10::Device device) {
  return std::make_unique<CudaScope>(limit_bytes, visible_index(device, "MemoryBudget"));
}
#else
int64_t cuda_headroom_bytes(c10::Device device) {
  TORCH_CHECK_VALUE(false, "memory_headroom_bytes: device '", device.str(), "' needs gpuops built with CUDA");
}

std::unique_ptr<MemoryBudget::Scope> make_cuda_scope(int64_t, c10::Device device) {
  TORCH_CHECK_VALUE(false, "MemoryBudget: device '", device.str(),
                    "' needs gpuops built with CUDA (GPUOPS_WITH_CUDA=ON); this build is CPU-only");
}
#endif

}  // namespace gpuops::memory
