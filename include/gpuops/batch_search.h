#pragma once
// OOM-safe batch-size search and the profiled memory estimator. The search finds the exact
// largest batch that runs, in few real trials, in-process. By default it profiles two small batches and then
// goes, trial by trial, to the batch that a model fitted on the two largest batches that ran says fills the
// memory: per allocation when the trials report their memory traces (every allocation's bytes-in-use is
// linear in the batch, so the peak's kinks are known from two small batches), else a fit of
// peak(b) = fixed + per_sample * b (exact once both lie on the final linear piece of the peak); with growth
// and bisection guards. Seeded by the analytic estimator, it gallops from that batch and bisects;
// without a seed it probes exponentially from `low` and bisects. Every trial's outcome is
// agreed by all ranks before the next, so a rank-local OOM never deadlocks the others.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace gpuops {

/// peak(b) = fixed_bytes + per_sample_bytes * b, fitted on measured trial peaks.
struct MemoryProfile {
  double fixed_bytes = 0;
  double per_sample_bytes = 0;
  std::vector<std::pair<int64_t, int64_t>> points;  ///< (batch, measured peak bytes)
  bool linear = true;  ///< false when a further point disagrees with the fit by more than the tolerance
  std::string note;    ///< why it is not linear

  /// Predicted peak bytes at `batch`.
  int64_t predict(int64_t batch) const;
  /// Largest batch whose predicted peak fits in `bytes` (0 when none does).
  int64_t max_batch_for(int64_t bytes) const;
};

/// Fits the first two points exactly (distinct batches) and checks the others within `tolerance` (relative).
/// c10::ValueError for fewer than two distinct batch sizes.
MemoryProfile fit_memory_profile(const std::vector<std::pair<int64_t, int64_t>>& points, double tolerance = 0.05);

/// One trial of a batch size, as the search recorded it.
struct BatchTrial {
  int64_t batch = 0;
  bool ok = false;            ///< agreed by every rank
  int64_t peak_bytes = 0;     ///< this process's peak over the trial's start (0 for an OOM'd trial: unknown)
  double seconds = 0;
  std::string phase;          ///< "profile" or "search"
};

struct BatchSearchResult {
  int64_t max_batch = 0;    ///< the largest batch that ran
  int64_t recommended = 0;  ///< after the safety margin and multiple-of rounding
  std::vector<BatchTrial> trials;
  std::optional<MemoryProfile> profile;
  bool complete = true;     ///< false when max_trials or max_seconds stopped the search early
  bool from_cache = false;
};

struct BatchSearchOptions {
  int64_t low = 1;                  ///< smallest batch to consider (>= 1)
  /// Largest batch to consider. Unset: the memory the trials may use in bytes (headroom_bytes, else the
  /// host's physical memory), since a batch of b samples takes at least b bytes; a step that still runs
  /// there does not grow with the batch, and the search says so (c10::ValueError) instead of probing on.
  std::optional<int64_t> high;
  int64_t multiple_of = 1;          ///< only multiples of this are tried (>= 1)
  double margin = 0.0;              ///< recommended = max_batch * (1 - margin), in [0, 1)
  bool profile_seed = true;         ///< profile two small batches and start from the fit's prediction
  std::optional<int64_t> seed;      ///< start from this batch instead (e.g. the analytic estimator's)
  int64_t headroom_bytes = -1;      ///< memory the trials may use, for the profile seed; -1: detect
  int64_t steps_per_trial = 2;      ///< a warm-up step plus one full step
  int64_t max_trials = 0;           ///< 0: no limit
  double max_seconds = 0;           ///< 0: no limit
  /// JSON results keyed by cache_key; empty: no cache. A regular file or a new name in an existing folder
  /// (c10::ValueError otherwise, before any trial). An entry's max_batch is taken down to a multiple of
  /// multiple_of; one that is not an integer >= 1 (or its multiple_of), or gives no batch in [low, high], is
  /// ignored with a warning and searched again. A cache that cannot be written is a warning, not a lost result.
  std::string cache_file;
  std::string cache_key;            ///< e.g. "GPU model|model signature|dtype|sequence length"
  /// One line per trial on stderr, as Lightning's finder logs ("batch 512: runs, peak 3.10 GiB, 1.4 s").
  bool verbose = true;
};

/// What one trial reports: ok=false for an out-of-memory; any other error is thrown.
struct TrialOutcome {
  bool ok = false;
  int64_t peak_bytes = 0;
  double seconds = 0;
  /// Optional: bytes in use (from the search's start) after each allocation of the trial's last step and
  /// validation (MemoryBudget::take_trace). Two traces of equal length give the peak at any batch.
  std::vector<int64_t> trace;
};
using TrialRunner = std::function<TrialOutcome(int64_t batch)>;
/// Minimum of a value over all ranks (identity in one process).
using AgreeMin = std::function<int64_t(int64_t)>;

/// The search itself, over any trial runner (the C++ and Python front ends provide theirs).
/// c10::OutOfMemoryError when even `low` does not run; c10::ValueError for bad options.
BatchSearchResult search_max_batch(const TrialRunner& run, const BatchSearchOptions& options,
                                   const AgreeMin& agree_min = {});

/// One full training step (forward, backward, optimizer step) at `batch`.
using TrainingStep = std::function<void(int64_t batch)>;

struct FindBatchOptions : BatchSearchOptions {
  c10::Device device = c10::Device(c10::kCPU);        ///< where the step allocates (its memory is measured)
  std::function<void(int64_t batch)> validate;        ///< run after the steps of each trial, if given
  c10::intrusive_ptr<c10d::Backend> process_group;    ///< every rank agrees on each trial (null: alone)
};

/// find_max_batch_size for LibTorch: runs `step` steps_per_trial times per trial, recognises OOM by type
/// (c10::OutOfMemoryError; cuBLAS/cuDNN allocation failures on CUDA), releases cached memory and resets peak
/// statistics after each failure; other exceptions propagate unchanged.
BatchSearchResult find_max_batch_size(const TrainingStep& step, const FindBatchOptions& options = {});

/// Runs one trial per batch size and fits peak(b) = fixed + per_sample * b (linear=false with a third point
/// that disagrees). c10::OutOfMemoryError if a profiling trial runs out of memory.
MemoryProfile profile_memory(const TrainingStep& step, const std::vector<int64_t>& batch_sizes = {1, 2},
                             c10::Device device = c10::Device(c10::kCPU), int64_t steps_per_trial = 2);

}  // namespace gpuops
