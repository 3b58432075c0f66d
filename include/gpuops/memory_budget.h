#pragma once
// MemoryBudget: counts the bytes a scope allocates and makes an allocation past a byte
// limit fail with c10::OutOfMemoryError, exactly where a GPU would run out. On the CPU it installs a
// counting allocator in front of c10's; on CUDA it reads the caching allocator's statistics and caps
// it with a memory fraction.

#include <cstdint>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

namespace gpuops {

/// Snapshot of a budget's counters, in bytes.
struct MemoryStats {
  int64_t current_bytes = 0;      ///< allocated inside the scope and not yet freed
  int64_t peak_bytes = 0;         ///< highest current_bytes since the scope began (or reset_peak)
  int64_t limit_bytes = -1;       ///< -1: no limit
  int64_t allocations = 0;        ///< successful allocations counted
  int64_t failed_allocations = 0; ///< allocations refused because of this budget
};

/// RAII scope that counts allocations and enforces a byte limit; the previous allocator (CPU) or
/// memory fraction (CUDA) is restored when the last scope ends, also when an exception unwinds.
/// Budgets nest: an allocation counts in every active scope and fails if any scope's limit is hit.
class MemoryBudget {
 public:
  static constexpr int64_t kUnlimited = -1;

  /// limit_bytes: > 0, or kUnlimited to only count. device: CPU, or a CUDA device.
  explicit MemoryBudget(int64_t limit_bytes = kUnlimited, c10::Device device = c10::Device(c10::kCPU));
  ~MemoryBudget();
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  /// Current counters of this scope.
  MemoryStats stats() const;
  int64_t current_bytes() const { return stats().current_bytes; }
  int64_t peak_bytes() const { return stats().peak_bytes; }
  int64_t limit_bytes() const { return limit_bytes_; }
  c10::Device device() const { return device_; }
  /// Starts a new peak from the current value.
  void reset_peak();
  /// Starts recording, at each allocation counted in this scope, its current bytes just after it (the memory
  /// curve of a training step, one value per allocation; what the batch-size search fits per allocation).
  /// CPU only: on CUDA the trace stays empty.
  void start_trace();
  /// Stops recording and returns the trace (empty when none was started, on CUDA, or past 16M events).
  std::vector<int64_t> take_trace();

  /// Implementation per device kind (CPU counting allocator, CUDA caching-allocator statistics).
  class Scope;

 private:
  int64_t limit_bytes_;
  c10::Device device_;
  std::unique_ptr<Scope> scope_;
};

/// RAII: CPU allocations this thread makes while it lives are neither counted nor refused by any budget (what
/// undoes a measured run, e.g. the batch search putting the model back, must not fail or count under the budget
/// it measured). Nests. Frees of such memory are not counted either. On CUDA it has no effect.
class UnbudgetedScope {
 public:
  UnbudgetedScope();
  ~UnbudgetedScope();
  UnbudgetedScope(const UnbudgetedScope&) = delete;
  UnbudgetedScope& operator=(const UnbudgetedScope&) = delete;
};

/// Bytes that allocations on `device` may still take: on the CPU the tightest active budget's limit minus
/// its current bytes (-1 when no budget with a limit is active: unknown); on CUDA the free device memory plus
/// what the caching allocator holds unused, within its memory fraction (a MemoryBudget cap).
int64_t memory_headroom_bytes(c10::Device device = c10::Device(c10::kCPU));

/// The memory a batch search's trials may use when nothing bounds them: on the CPU with no MemoryBudget limit
/// active, 90% of the host memory available now (the search then runs under that budget, so that an overflow
/// is an OutOfMemoryError, not the kernel's OOM killer); otherwise MemoryBudget::kUnlimited (an active budget,
/// or the GPU's own memory, bounds them).
int64_t default_search_limit(c10::Device device = c10::Device(c10::kCPU));

}  // namespace gpuops
