#pragma once
// The device-specific half of MemoryBudget: one Scope per active budget.
#include <memory>
#include <vector>

#include "gpuops/memory_budget.h"

namespace gpuops {

class MemoryBudget::Scope {
 public:
  virtual ~Scope() = default;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  virtual void start_trace() {}  // devices without an allocation hook record nothing
  virtual std::vector<int64_t> take_trace() { return {}; }
};

namespace memory {

/// Counts through the process-wide CPU counting allocator (cpu_counting_allocator.cpp).
std::unique_ptr<MemoryBudget::Scope> make_cpu_scope(int64_t limit_bytes);
/// Reads and caps the CUDA caching allocator (cuda_scope.cpp; an error in builds without CUDA).
std::unique_ptr<MemoryBudget::Scope> make_cuda_scope(int64_t limit_bytes, c10::Device device);

/// UnbudgetedScope: the calling thread's allocations bypass the CPU budgets while depth > 0.
void enter_unbudgeted();
void leave_unbudgeted();

/// RAII: while one lives, the CPU allocations of every thread bypass the budgets (nests). For the ranks'
/// agreements: their few bytes must never be refused on one rank (it would raise out of memory alone while
/// the others wait for the timeout), and the communication library allocates its temporaries on its own
/// threads, which a thread-local scope does not reach. Another thread's allocation made meanwhile is neither
/// counted nor refused either: agreements are short and run between the training's steps.
class UnbudgetedEverywhere {
 public:
  UnbudgetedEverywhere();
  ~UnbudgetedEverywhere();
  UnbudgetedEverywhere(const UnbudgetedEverywhere&) = delete;
  UnbudgetedEverywhere& operator=(const UnbudgetedEverywhere&) = delete;
};

/// memory_headroom_bytes for each device kind.
int64_t cpu_headroom_bytes();
int64_t cuda_headroom_bytes(c10::Device device);

}  // namespace memory
}  // namespace gpuops
