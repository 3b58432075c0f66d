// The CPU half of MemoryBudget: a counting allocator installed in front of c10's CPU allocator.
//
// Why a process-wide singleton that is never destroyed: every StorageImpl keeps a raw pointer to the
// allocator that made it and calls it again to resize, possibly long after the budget ended. So the
// allocator object lives forever; a budget only adds a scope to its list, and once no scope is active
// it forwards to the allocator it replaced (and is uninstalled from c10's registry).
//
// Data pointers stay "simple" (context == data, as c10's default CPU allocator makes them) so that
// copy-on-write clones and raw_allocate keep working; the bookkeeping lives in a side table.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include "memory_scope.h"

namespace gpuops::memory {
namespace {

struct ScopeCounters {
  int64_t limit = MemoryBudget::kUnlimited;
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocations = 0;
  int64_t failed = 0;
  bool tracing = false;
  bool trace_overflow = false;
  std::vector<int64_t> trace;  // current bytes after each allocation while tracing
};

constexpr size_t kMaxTraceEvents = size_t{1} << 24;  // 128 MiB of trace at most; past it the trace is dropped

thread_local int unbudgeted_depth = 0;  // UnbudgetedScope nesting of this thread
std::atomic<int> unbudgeted_everywhere{0};  // UnbudgetedEverywhere nesting, every thread
using ScopeList = std::vector<std::shared_ptr<ScopeCounters>>;

// One live allocation made while scopes were active: the real allocation and the scopes it counts in.
struct Record {
  c10::DataPtr inner;
  int64_t bytes;
  std::shared_ptr<const ScopeList> scopes;
};

void counting_delete(void* ptr);
void counting_raw_delete(void* ptr);

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    std::unique_lock<std::mutex> lock(mutex_);
    c10::Allocator* underlying = underlying_;
    if (!scopes_ || n == 0 || unbudgeted_depth > 0 || unbudgeted_everywhere.load() > 0) {
      lock.unlock();
      return underlying->allocate(n);
    }
    const auto bytes = static_cast<int64_t>(n);
    for (const auto& scope : *scopes_) {
      if (scope->limit != MemoryBudget::kUnlimited && scope->current + bytes > scope->limit) {
        ++scope->failed;
        const int64_t current = scope->current, limit = scope->limit;
        lock.unlock();
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory under gpuops.MemoryBudget: tried to allocate ",
                         bytes, " bytes with ", current, " of limit_bytes=", limit, " already in use");
      }
    }
    c10::DataPtr inner = underlying->allocate(n);  // may throw: nothing counted yet
    void* data = inner.get();
    for (const auto& scope : *scopes_) {
      scope->current += bytes;
      scope->peak = std::max(scope->peak, scope->current);
      ++scope->allocations;
      if (scope->tracing) {
        if (scope->trace.size() < kMaxTraceEvents) {
          scope->trace.push_back(scope->current);
        } else {
          scope->trace_overflow = true;
        }
      }
    }
    const c10::Device device = inner.device();
    records_.emplace(data, Record{std::move(inner), bytes, scopes_});
    return {data, data, &counting_delete, device};
  }

  // raw_allocate() hands out bare pointers, also ones forwarded while no budget was active (callers may
  // cache this allocator), so the raw deleter frees pointers it has no record of through the allocator
  // that made them.
  c10::DeleterFnPtr raw_deleter() const override { return &counting_raw_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Frees a pointer this allocator recorded; returns false (and does nothing) for any other pointer.
  bool release(void* ptr) {
    c10::DataPtr inner;  // destroyed after the lock is dropped: the real free happens outside it
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = records_.find(ptr);
      if (it == records_.end()) return false;
      for (const auto& scope : *it->second.scopes) scope->current -= it->second.bytes;
      inner = std::move(it->second.inner);
      records_.erase(it);
    }
    return true;
  }

  void raw_release(void* ptr) {
    if (release(ptr)) return;
    c10::DeleterFnPtr underlying_delete = underlying_->raw_deleter();
    TORCH_INTERNAL_ASSERT(underlying_delete, "gpuops counting allocator: no raw deleter to free an unknown pointer");
    underlying_delete(ptr);
  }

  std::shared_ptr<ScopeCounters> push(int64_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    c10::Allocator* installed = c10::GetAllocator(c10::kCPU);
    if (installed != this) {
      underlying_ = installed;
      c10::SetAllocator(c10::kCPU, this);
      if (c10::GetAllocator(c10::kCPU) != this) {
        TORCH_CHECK(false, "MemoryBudget: another CPU allocator with a higher priority is installed; "
                           "the budget cannot count CPU allocations");
      }
    }
    auto scope = std::make_shared<ScopeCounters>();
    scope->limit = limit;
    auto next = std::make_shared<ScopeList>(scopes_ ? *scopes_ : ScopeList{});
    next->push_back(scope);
    scopes_ = std::move(next);
    return scope;
  }

  // Scopes may end in any order; the last one to end puts the replaced allocator back.
  void pop(const std::shared_ptr<ScopeCounters>& scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = std::make_shared<ScopeList>(*scopes_);
    next->erase(std::remove(next->begin(), next->end(), scope), next->end());
    if (next->empty()) {
      scopes_.reset();
      if (c10::GetAllocator(c10::kCPU) == this) c10::SetAllocator(c10::kCPU, underlying_);
    } else {
      scopes_ = std::move(next);
    }
  }

  MemoryStats stats(const ScopeCounters& scope) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {scope.current, scope.peak, scope.limit, scope.allocations, scope.failed};
  }

  int64_t headroom() const {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t room = -1;
    if (scopes_) {
      for (const auto& scope : *scopes_)
        if (scope->limit != MemoryBudget::kUnlimited)
          room = room < 0 ? scope->limit - scope->current : std::min(room, scope->limit - scope->current);
    }
    return room < 0 ? -1 : room;
  }

  void reset_peak(ScopeCounters& scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    scope.peak = scope.current;
  }

  void start_trace(ScopeCounters& scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    scope.trace.clear();
    scope.trace_overflow = false;
    scope.tracing = true;
  }

  std::vector<int64_t> take_trace(ScopeCounters& scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> trace;
    if (!scope.trace_overflow) trace.swap(scope.trace);
    scope.trace = {};
    scope.tracing = false;
    scope.trace_overflow = false;
    return trace;
  }

 private:
  mutable std::mutex mutex_;
  c10::Allocator* underlying_ = c10::GetAllocator(c10::kCPU);
  std::shared_ptr<const ScopeList> scopes_;  // null when no budget is active
  std::unordered_map<void*, Record> records_;
};

CountingAllocator& counting_allocator() {
  static auto* allocator = new CountingAllocator();  // never destroyed: storages keep pointing at it
  return *allocator;
}

void counting_delete(void* ptr) {
  const bool known = counting_allocator().release(ptr);
  TORCH_INTERNAL_ASSERT(known, "gpuops counting allocator: a pointer it did not record was freed");
}

void counting_raw_delete(void* ptr) { counting_allocator().raw_release(ptr); }

class CpuScope final : public MemoryBudget::Scope {
 public:
  explicit CpuScope(int64_t limit) : counters_(counting_allocator().push(limit)) {}
  ~CpuScope() override { counting_allocator().pop(counters_); }
  MemoryStats stats() const override { return counting_allocator().stats(*counters_); }
  void reset_peak() override { counting_allocator().reset_peak(*counters_); }
  void start_trace() override { counting_allocator().start_trace(*counters_); }
  std::vector<int64_t> take_trace() override { return counting_allocator().take_trace(*counters_); }

 private:
  std::shared_ptr<ScopeCounters> counters_;
};

}  // namespace

void enter_unbudgeted() { ++unbudgeted_depth; }

UnbudgetedEverywhere::UnbudgetedEverywhere() { ++unbudgeted_everywhere; }

UnbudgetedEverywhere::~UnbudgetedEverywhere() { --unbudgeted_everywhere; }

void leave_unbudgeted() { --unbudgeted_depth; }

int64_t cpu_headroom_bytes() { return counting_allocator().headroom(); }

std::unique_ptr<MemoryBudget::Scope> make_cpu_scope(int64_t limit_bytes) {
  return std::make_unique<CpuScope>(limit_bytes);
}

}  // namespace gpuops::memory
