// search_max_batch (batch_search.h): seed, gallop, bisect; every outcome agreed across ranks; a JSON cache.
#include <algorithm>
#include <chrono>
#include <climits>
#include <fstream>
#include <map>
#include <variant>

#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../state/posix_files.h"
#include "gpuops/batch_search.h"

namespace gpuops {
namespace {

using json = nlohmann::json;

// "3.10 GiB" or "212.4 MiB": a trial's peak as a person reads it.
std::string readable_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  return b >= (1 << 30) ? fmt::format("{:.2f} GiB", b / (1 << 30)) : fmt::format("{:.1f} MiB", b / (1 << 20));
}

// Saturating arithmetic: batch sizes near INT64_MAX (a user's high) must not wrap around.
int64_t sat_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}
int64_t sat_add(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

// Not std::filesystem (posix_files.h says why).
void check_cache_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    TORCH_CHECK_VALUE(S_ISREG(st.st_mode), "find_max_batch_size: cache_file must be a regular file or a new name, "
                      "got '", path, "', which is ", S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
    return;
  }
  const auto slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  TORCH_CHECK_VALUE(::stat(folder.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "find_max_batch_size: cache_file '",
                    path, "' is in a folder that does not exist ('", folder, "')");
}

void check_options(const BatchSearchOptions& o) {
  TORCH_CHECK_VALUE(o.low >= 1, "find_max_batch_size: low must be >= 1, got ", o.low);
  TORCH_CHECK_VALUE(!o.high || *o.high >= o.low, "find_max_batch_size: high must be >= low (", o.low, "), got ",
                    *o.high);
  TORCH_CHECK_VALUE(o.multiple_of >= 1, "find_max_batch_size: multiple_of must be >= 1, got ", o.multiple_of);
  TORCH_CHECK_VALUE(o.margin >= 0 && o.margin < 1, "find_max_batch_size: margin must be in [0, 1), got ", o.margin);
  TORCH_CHECK_VALUE(o.steps_per_trial >= 1, "find_max_batch_size: steps_per_trial must be >= 1, got ",
                    o.steps_per_trial);
  TORCH_CHECK_VALUE(o.max_trials >= 0, "find_max_batch_size: max_trials must be >= 0 (0: no limit), got ",
                    o.max_trials);
  TORCH_CHECK_VALUE(o.max_seconds >= 0, "find_max_batch_size: max_seconds must be >= 0 (0: no limit), got ",
                    o.max_seconds);
  TORCH_CHECK_VALUE(!o.seed || *o.seed >= 1, "find_max_batch_size: seed must be >= 1, got ", *o.seed);
  TORCH_CHECK_VALUE(o.headroom_bytes >= -1, "find_max_batch_size: headroom_bytes must be >= 0 (or -1: detect), got ",
                    o.headroom_bytes);
  TORCH_CHECK_VALUE(o.cache_file.empty() || !o.cache_key.empty(), "find_max_batch_size: a cache_file needs a cache_key");
  const int64_t unit = o.multiple_of;
  TORCH_CHECK_VALUE(o.low <= INT64_MAX - (unit - 1), "find_max_batch_size: low (", o.low, ") is too large");
  if (o.high) {
    const int64_t first = (o.low + unit - 1) / unit * unit;
    TORCH_CHECK_VALUE(first <= *o.high, "find_max_batch_size: no multiple of ", unit, " lies in [low, high] = [",
                      o.low, ", ", *o.high, "]");
  }
  if (!o.cache_file.empty()) check_cache_file(o.cache_file);
}

int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? sat_mul(pages, page) : INT64_MAX;
}

// The default high: a batch of b samples takes at least b bytes of the memory the trials may use.
int64_t default_high(const BatchSearchOptions& o) {
  const int64_t first = (o.low + o.multiple_of - 1) / o.multiple_of * o.multiple_of;
  const int64_t limit = o.headroom_bytes > 0 ? o.headroom_bytes : physical_memory_bytes();
  TORCH_CHECK_VALUE(first <= limit, "find_max_batch_size: the first batch, ", first, " (low=", o.low, ", multiple_of=",
                    o.multiple_of, "), exceeds the ", limit, " bytes the trials may use, so it cannot fit; pass a "
                    "smaller low or multiple_of, or high= to try it anyway");
  return limit;
}

int64_t recommended_for(int64_t max_batch, const BatchSearchOptions& o) {
  const int64_t unit = o.multiple_of, low_k = (o.low + unit - 1) / unit;
  const auto margin_k = static_cast<int64_t>(static_cast<double>(max_batch) * (1 - o.margin)) / unit;
  return std::max(low_k, std::min(margin_k, max_batch / unit)) * unit;
}

// The batch a cache entry answers for these options (its max_batch down to a multiple of multiple_of, exact
// because that is a multiple of the entry's own), or why it cannot.
std::variant<int64_t, std::string> entry_answer(const json& entry, const BatchSearchOptions& o) {
  if (!entry.is_object()) return std::string("it is not a JSON object");
  const auto max_batch = entry.find("max_batch");
  if (max_batch == entry.end() || !max_batch->is_number_integer() || max_batch->get<int64_t>() < 1)
    return std::string("max_batch is not an integer >= 1");
  const auto multiple_of = entry.find("multiple_of");
  if (multiple_of == entry.end() || !multiple_of->is_number_integer() || multiple_of->get<int64_t>() < 1)
    return std::string("multiple_of is not an integer >= 1");
  if (o.multiple_of % multiple_of->get<int64_t>() != 0)  // rounding down would not give the exact maximum
    return "it was searched with multiple_of " + multiple_of->dump() + ", which does not divide " +
           std::to_string(o.multiple_of);
  const int64_t value = max_batch->get<int64_t>() / o.multiple_of * o.multiple_of;
  if (value < o.low || (o.high && value > *o.high))
    return "max_batch " + max_batch->dump() + " gives no multiple of multiple_of in [low, high]";
  return value;
}

// The cached maximum for this key; nullopt without a cache or an entry, or with an entry this search cannot
// trust (a corrupt cache must not stop the search: the entry is searched again and overwritten).
std::optional<int64_t> cached(const BatchSearchOptions& o) {
  if (o.cache_file.empty()) return std::nullopt;
  std::ifstream in(o.cache_file);
  if (!in) return std::nullopt;
  json all;
  try {
    all = json::parse(in);
  } catch (const std::exception& e) {
    TORCH_WARN("find_max_batch_size: cache ", o.cache_file, " is unreadable (", e.what(), "); searching");
    return std::nullopt;
  }
  if (!all.is_object()) {
    TORCH_WARN("find_max_batch_size: cache ", o.cache_file, " is not a JSON object; searching");
    return std::nullopt;
  }
  if (!all.contains(o.cache_key)) return std::nullopt;
  const auto answer = entry_answer(all.at(o.cache_key), o);
  if (const auto* problem = std::get_if<std::string>(&answer)) {
    TORCH_WARN("find_max_batch_size: ignoring the entry '", o.cache_key, "' of cache ", o.cache_file, " (", *problem,
               "); searching");
    return std::nullopt;
  }
  return std::get<int64_t>(answer);
}

// Writing the cache is a convenience: a failure warns and keeps the result.
void store(const BatchSearchOptions& o, const BatchSearchResult& r) {
  if (o.cache_file.empty() || !r.complete) return;
  json all = json::object();
  if (std::ifstream in(o.cache_file); in) {
    try {
      all = json::parse(in);
    } catch (const std::exception&) {  // rewritten whole below
    }
  }
  if (!all.is_object()) all = json::object();
  all[o.cache_key] = {{"max_batch", r.max_batch}, {"recommended", r.recommended},
                      {"margin", o.margin}, {"multiple_of", o.multiple_of}, {"trials", r.trials.size()}};
  try {
    detail::write_atomically(o.cache_file, all.dump(1));
  } catch (const std::exception& e) {
    TORCH_WARN("find_max_batch_size: could not write cache ", o.cache_file, " (", e.what(), "); result not cached");
  }
}

// The search's state: what ran, what failed, and the budget of trials and time.
class Search {
 public:
  Search(const TrialRunner& run, const BatchSearchOptions& options, const AgreeMin& agree_min)
      : run_(run), o_(options), agree_min_(agree_min), start_(std::chrono::steady_clock::now()) {}

  // Batch sizes are k * multiple_of; these helpers work in k. high is always set (check_options or the
  // default), so k * unit never overflows.
  int64_t unit() const { return o_.multiple_of; }
  int64_t low_k() const { return (o_.low + unit() - 1) / unit(); }
  int64_t high_k() const { return *o_.high / unit(); }
  int64_t clamp_k(int64_t k) const { return std::max(low_k(), std::min(k, high_k())); }
  bool at_high() const { return best_ok_k && *best_ok_k >= high_k(); }
  bool bracketed() const { return first_fail_k && *first_fail_k - *best_ok_k <= 1; }

  int64_t agree(int64_t value) const { return agree_min_ ? agree_min_(value) : value; }

  bool out_of_budget() {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if ((o_.max_trials > 0 && static_cast<int64_t>(result.trials.size()) >= o_.max_trials) ||
        (o_.max_seconds > 0 && seconds >= o_.max_seconds)) {
      result.complete = false;
      return true;
    }
    return false;
  }

  // Runs batch k * unit unless already known; true when it ran on every rank.
  bool runs(int64_t k, const char* phase) {
    if (best_ok_k && k <= *best_ok_k) return true;
    if (first_fail_k && k >= *first_fail_k) return false;
    const int64_t batch = k * unit();
    TrialOutcome outcome = run_(batch);
    // A runner's bug (a negative peak) is its own error, not one of the memory fit that reads it later.
    TORCH_CHECK_VALUE(outcome.peak_bytes >= 0, "find_max_batch_size: the trial of batch ", batch,
                      " reported peak_bytes ", outcome.peak_bytes, "; accepted: >= 0");
    const bool ok = agree(outcome.ok ? 1 : 0) == 1;
    result.trials.push_back({batch, ok, outcome.peak_bytes, outcome.seconds, phase});
    if (o_.verbose)
      fmt::print(stderr, "find_max_batch_size: batch {}: {}, {:.1f} s ({})\n", batch,
                 ok ? "runs, peak " + readable_bytes(outcome.peak_bytes) : std::string("out of memory"),
                 outcome.seconds, phase);
    if (ok) {
      best_ok_k = k;
      ok_peaks_[k] = outcome.peak_bytes;
      if (!outcome.trace.empty()) traces_[k] = std::move(outcome.trace);
    } else {
      first_fail_k = first_fail_k ? std::min(*first_fail_k, k) : k;
      TORCH_CHECK_WITH(OutOfMemoryError, k > low_k(), "find_max_batch_size: even the smallest batch, ", batch,
                       " (low=", o_.low, ", multiple_of=", o_.multiple_of, "), runs out of memory; shorten the "
                       "sequences, checkpoint activations, use a smaller model or precision, or give it more memory");
    }
    return ok;
  }

  // peak(b) fitted on the two largest batches that ran; nullopt with fewer than two.
  std::optional<MemoryProfile> fit_two_largest() const {
    if (ok_peaks_.size() < 2) return std::nullopt;
    const auto last = std::prev(ok_peaks_.end()), before = std::prev(last);
    return fit_memory_profile({{before->first * unit(), before->second}, {last->first * unit(), last->second}});
  }

  // The largest k whose every allocation stays within `headroom` bytes, from the traces of the largest batch
  // that ran and the largest smaller one with as many allocations (the same program): the bytes in use after
  // allocation i are t_i(b) = t_i(b0) + (t_i(b1) - t_i(b0)) * (b - b0) / (b1 - b0), exactly, when every
  // tensor's size is affine in the batch. Integer arithmetic, so the answer is exact. nullopt without such a
  // pair or when no allocation grows with the batch.
  std::optional<int64_t> trace_prediction_k(int64_t headroom) const {
    const auto pair = trace_pair();
    if (!pair) return std::nullopt;
    const auto [smaller, top] = *pair;
    const __int128 b0 = smaller->first * unit(), b1 = top->first * unit();
    const auto& t0 = smaller->second;
    const auto& t1 = top->second;
    std::optional<__int128> limit;
    for (size_t i = 0; i < t0.size(); ++i) {
      const __int128 grows = static_cast<__int128>(t1[i]) - t0[i];
      if (grows <= 0) continue;
      const __int128 room = static_cast<__int128>(headroom) - t0[i];
      // largest b with t0 + grows * (b - b0) / (b1 - b0) <= headroom; floor division for a negative room
      const __int128 num = room * (b1 - b0);
      const __int128 steps = num >= 0 ? num / grows : -((-num + grows - 1) / grows);
      limit = limit ? std::min(*limit, b0 + steps) : b0 + steps;
    }
    if (!limit) return std::nullopt;
    const __int128 k = *limit / unit();
    return static_cast<int64_t>(std::clamp<__int128>(k, 0, INT64_MAX));
  }

  // Traces were reported, but no two have as many allocations (a batch of 1 often takes other paths:
  // size-1 dimensions make more tensors contiguous).
  bool traces_unpaired() const { return traces_.size() >= 2 && !trace_pair(); }

  BatchSearchResult result;
  std::optional<int64_t> best_ok_k, first_fail_k;

 private:
  using TraceMap = std::map<int64_t, std::vector<int64_t>>;
  // The largest traced batch and the largest smaller one with as many allocations.
  std::optional<std::pair<TraceMap::const_iterator, TraceMap::const_iterator>> trace_pair() const {
    if (traces_.size() < 2) return std::nullopt;
    const auto top = std::prev(traces_.end());
    for (auto it = top; it != traces_.begin();) {
      --it;
      if (it->second.size() == top->second.size()) return std::make_pair(it, top);
    }
    return std::nullopt;
  }

  std::map<int64_t, int64_t> ok_peaks_;               // measured peak of each batch that ran (in k)
  TraceMap traces_;                                   // memory trace of each batch that ran with one
  const TrialRunner& run_;
  const BatchSearchOptions& o_;
  const AgreeMin& agree_min_;
  std::chrono::steady_clock::time_point start_;
};

// The profile-seeded search. The peak of a training step is the largest of several phases' linear laws (a
// convex, piecewise-linear function of the batch); at small batches a fixed phase (optimizer state, its
// temporaries) often dominates, so the peak may not grow at all there. When the trials report memory traces,
// each allocation's bytes-in-use is its own linear law, and two small batches give all of them: the batch
// where the first of them reaches the headroom is the answer, whichever phase holds the peak at small
// batches. Without traces, each step fits peak(b) on the two largest batches that ran and goes to the batch
// that fit says fills the headroom: on the final linear piece that is exact. Either way the search ends by
// confirming that one more fails. Guards: without a trace model grow at most kGrowth-fold per trial (memory
// may not grow yet, or the fit may lie on an earlier piece); a prediction at or past a failed batch bisects.
void profile_seeded_search(Search& s, const BatchSearchOptions& o) {
  constexpr int64_t kGrowth = 16;
  const int64_t low = s.low_k();
  s.runs(low, "profile");
  s.runs(s.clamp_k(2 * low), "profile");
  bool small_probe = false;
  while (!s.out_of_budget()) {
    const int64_t best = *s.best_ok_k;
    if (s.at_high() || s.bracketed()) return;
    int64_t next = sat_mul(best, o.headroom_bytes > 0 ? kGrowth : 2);  // no headroom known: probe
    if (o.headroom_bytes > 0) {
      if (const auto traced = s.trace_prediction_k(o.headroom_bytes)) {
        next = *traced <= best ? best + 1 : *traced;
      } else if (!small_probe && s.traces_unpaired()) {  // one small, safe batch for a trace pair
        small_probe = true;
        next = best + low;
      } else if (const auto fit = s.fit_two_largest(); fit && fit->per_sample_bytes > 0) {
        const int64_t predicted = fit->max_batch_for(o.headroom_bytes) / s.unit();
        next = predicted <= best ? best + 1 : std::min(predicted, next);
      }
    }
    if (const auto fit = s.fit_two_largest(); fit && fit->per_sample_bytes > 0) s.result.profile = fit;
    next = s.agree(next);  // every rank goes to the smallest rank's choice (one agreement per step)
    if (s.first_fail_k && next >= *s.first_fail_k) next = std::max(best + 1, best + (*s.first_fail_k - best) / 2);
    s.runs(s.clamp_k(next), "search");
  }
}

}  // namespace

BatchSearchResult search_max_batch(const TrialRunner& run, const BatchSearchOptions& options,
                                   const AgreeMin& agree_min) {
  TORCH_CHECK_VALUE(static_cast<bool>(run), "find_max_batch_size: run must be a function");
  check_options(options);
  if (const auto hit = cached(options)) {
    BatchSearchResult r;
    r.max_batch = *hit;
    r.recommended = recommended_for(*hit, options);
    r.from_cache = true;
    return r;
  }
  BatchSearchOptions o = options;
  const bool derived_high = !o.high;
  if (derived_high) o.high = agree_min ? agree_min(default_high(o)) : default_high(o);  // one bound for all ranks
  Search s(run, o, agree_min);
  if (o.seed) {  // gallop away from the estimate: up while it runs, down while it fails
    const int64_t start_k = s.clamp_k(*o.seed / s.unit());
    if (s.runs(start_k, "search")) {
      for (int64_t step = 1; !s.first_fail_k && !s.at_high() && !s.out_of_budget(); step = sat_mul(step, 2))
        s.runs(s.clamp_k(sat_add(*s.best_ok_k, step)), "search");
    } else {
      for (int64_t step = 1; !s.best_ok_k && !s.out_of_budget(); step = sat_mul(step, 2))
        s.runs(std::max(s.low_k(), start_k - step), "search");
    }
  } else if (o.profile_seed) {
    profile_seeded_search(s, o);
  } else {  // exponential probing from low
    s.runs(s.low_k(), "search");
    while (!s.first_fail_k && !s.at_high() && !s.out_of_budget()) s.runs(s.clamp_k(sat_mul(*s.best_ok_k, 2)), "search");
  }
  while (s.first_fail_k && s.best_ok_k && !s.bracketed() && !s.out_of_budget())  // bisection
    s.runs(*s.best_ok_k + (*s.first_fail_k - *s.best_ok_k) / 2, "search");

  TORCH_CHECK_WITH(OutOfMemoryError, s.best_ok_k.has_value(), "find_max_batch_size: max_trials (", o.max_trials,
                   ") or max_seconds (", o.max_seconds, ") ran out before any batch ran");
  TORCH_CHECK_VALUE(!(derived_high && s.at_high()), "find_max_batch_size: batch ", s.high_k() * s.unit(),
                    " ran without running out of memory, yet a batch of b samples takes at least b bytes and the "
                    "trials may use at most ", o.high.value(), " (", o.headroom_bytes > 0 ? "headroom_bytes" :
                    "the host's physical memory", "): the step's memory does not grow with its batch argument. Make step(batch) use the batch, or "
                    "pass high= to bound the search");
  BatchSearchResult& r = s.result;
  r.max_batch = *s.best_ok_k * s.unit();
  r.recommended = recommended_for(r.max_batch, o);
  store(o, r);
  return r;
}

}  // namespace gpuops
