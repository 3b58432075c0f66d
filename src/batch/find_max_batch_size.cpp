// find_max_batch_size and profile_memory for LibTorch (batch_search.h): real trials measured by a
// MemoryBudget counter, OOM recognised by type, agreement over a c10d backend.
#include <chrono>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "gpuops/batch_search.h"
#include "gpuops/memory_budget.h"

namespace gpuops {
namespace {

// cuBLAS and cuDNN report a failed workspace allocation as a c10::Error carrying their status name.
bool is_library_allocation_failure(const c10::Error& e) {
  const char* message = e.what_without_backtrace();
  return std::strstr(message, "CUBLAS_STATUS_ALLOC_FAILED") || std::strstr(message, "CUDNN_STATUS_ALLOC_FAILED");
}

void release_cached_memory(c10::Device device) {
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#else
  (void)device;
#endif
}

// One trial. `counter` spans the whole search, so peaks are measured from the search's start: memory that a
// trial leaves behind (optimizer state made by the first step) counts in every later trial's peak, and the
// fitted law peak(b) holds across trials.
TrialOutcome run_trial(const TrainingStep& step, const std::function<void(int64_t)>& validate, int64_t batch,
                       int64_t steps, MemoryBudget& counter) {
  TrialOutcome outcome;
  counter.reset_peak();
  const auto start = std::chrono::steady_clock::now();
  try {
    for (int64_t i = 0; i < steps; ++i) {
      if (i == steps - 1) counter.start_trace();  // the last step: earlier ones may still create state
      step(batch);
    }
    if (validate) validate(batch);
    outcome.ok = true;
  } catch (const c10::OutOfMemoryError&) {
    outcome.ok = false;  // the exception and everything the step held are gone once we are here
  } catch (const c10::Error& e) {
    if (!is_library_allocation_failure(e)) throw;
    outcome.ok = false;
  }
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  outcome.peak_bytes = counter.peak_bytes();
  outcome.trace = counter.take_trace();
  if (!outcome.ok) {
    outcome.trace.clear();
    release_cached_memory(counter.device());
  }
  return outcome;
}

AgreeMin over(const c10::intrusive_ptr<c10d::Backend>& group) {
  if (!group) return {};
  return [group](int64_t value) {
    const bool nccl = group->getBackendName() == "nccl";
    std::vector<at::Tensor> tensors{at::full({1}, value, at::TensorOptions(at::kLong).device(nccl ? at::kCUDA : at::kCPU))};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    group->allreduce(tensors, min)->wait();
    return tensors[0].item<int64_t>();
  };
}

}  // namespace

BatchSearchResult find_max_batch_size(const TrainingStep& step, const FindBatchOptions& options) {
  TORCH_CHECK_VALUE(static_cast<bool>(step), "find_max_batch_size: step must be a function");
  BatchSearchOptions search = options;
  // Nothing bounds the trials on a CPU without a budget: they get one, said aloud (a search doubled up to
  // the OOM killer before).
  const int64_t limit = default_search_limit(options.device);
  if (limit != MemoryBudget::kUnlimited)
    TORCH_WARN("find_max_batch_size: no memory budget is active on the CPU, so the trials may use ", limit >> 20,
               " MiB (90% of the memory available now); give one with gpuops::MemoryBudget to stand for a GPU");
  if (search.headroom_bytes < 0)
    search.headroom_bytes = limit != MemoryBudget::kUnlimited ? limit : memory_headroom_bytes(options.device);
  MemoryBudget counter(limit, options.device);
  const TrialRunner run = [&](int64_t batch) {
    return run_trial(step, options.validate, batch, options.steps_per_trial, counter);
  };
  return search_max_batch(run, search, over(options.process_group));
}

MemoryProfile profile_memory(const TrainingStep& step, const std::vector<int64_t>& batch_sizes, c10::Device device,
                             int64_t steps_per_trial) {
  TORCH_CHECK_VALUE(static_cast<bool>(step), "profile_memory: step must be a function");
  TORCH_CHECK_VALUE(steps_per_trial >= 1, "profile_memory: steps_per_trial must be >= 1, got ", steps_per_trial);
  std::vector<std::pair<int64_t, int64_t>> points;
  for (int64_t batch : batch_sizes) {
    TORCH_CHECK_VALUE(batch >= 1, "profile_memory: batch_sizes must be >= 1, got ", batch);
    MemoryBudget counter(MemoryBudget::kUnlimited, device);  // each point from the same starting state
    const auto outcome = run_trial(step, {}, batch, steps_per_trial, counter);
    TORCH_CHECK_WITH(OutOfMemoryError, outcome.ok, "profile_memory: batch ", batch,
                     " runs out of memory; profile smaller batch sizes");
    points.emplace_back(batch, outcome.peak_bytes);
  }
  return fit_memory_profile(points);
}

}  // namespace gpuops
