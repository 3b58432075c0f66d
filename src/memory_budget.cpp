// MemoryBudget: argument checks and the choice of the CPU or CUDA scope.
#include "gpuops/memory_budget.h"

#include "gpuops/device.h"

#include <c10/util/Exception.h>

#include "memory/memory_scope.h"

namespace gpuops {

MemoryBudget::MemoryBudget(int64_t limit_bytes, c10::Device device)
    : limit_bytes_(limit_bytes), device_(device) {
  TORCH_CHECK_VALUE(limit_bytes > 0 || limit_bytes == kUnlimited,
                    "MemoryBudget: limit_bytes must be > 0 (or -1 for no limit), got ", limit_bytes);
  if (device.is_cpu()) {
    scope_ = memory::make_cpu_scope(limit_bytes);
  } else if (device.is_cuda()) {
    scope_ = memory::make_cuda_scope(limit_bytes, device);
  } else {
    TORCH_CHECK_VALUE(false, "MemoryBudget: device must be 'cpu' or 'cuda[:index]', got '", device.str(), "'");
  }
}

MemoryBudget::~MemoryBudget() = default;

MemoryStats MemoryBudget::stats() const { return scope_->stats(); }

void MemoryBudget::reset_peak() { scope_->reset_peak(); }

void MemoryBudget::start_trace() { scope_->start_trace(); }

std::vector<int64_t> MemoryBudget::take_trace() { return scope_->take_trace(); }

UnbudgetedScope::UnbudgetedScope() { memory::enter_unbudgeted(); }

UnbudgetedScope::~UnbudgetedScope() { memory::leave_unbudgeted(); }

int64_t memory_headroom_bytes(c10::Device device) {
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "memory_headroom_bytes: device must be cpu or cuda, got ",
                    device.str());
  return device.is_cpu() ? memory::cpu_headroom_bytes() : memory::cuda_headroom_bytes(device);
}

int64_t default_search_limit(c10::Device device) {
  if (!device.is_cpu() || memory::cpu_headroom_bytes() >= 0) return MemoryBudget::kUnlimited;
  return available_host_memory_bytes() / 10 * 9;
}

}  // namespace gpuops
