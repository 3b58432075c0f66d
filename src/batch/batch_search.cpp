// search_max_batch (batch_search.h): seed, gallop, bisect; every outcome agreed across ranks; a JSON cache.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "../state/posix_files.h"
#include "gpuops/batch_search.h"

namespace gpuops {
namespace {

using json = nlohmann::json;

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
  TORCH_CHECK_VALUE(o.cache_file.empty() || !o.cache_key.empty(), "find_max_batch_size: a cache_file needs a cache_key");
  if (o.high) {
    const int64_t first = (o.low + o.multiple_of - 1) / o.multiple_of * o.multiple_of;
    TORCH_CHECK_VALUE(first <= *o.high, "find_max_batch_size: no multiple of ", o.multiple_of, " lies in [low, high] = [",
                      o.low, ", ", *o.high, "]");
  }
}

std::optional<json> cached(const BatchSearchOptions& o) {
  if (o.cache_file.empty()) return std::nullopt;
  std::ifstream in(o.cache_file);
  if (!in) return std::nullopt;
  try {
    const auto all = json::parse(in);
    if (all.contains(o.cache_key)) return all.at(o.cache_key);
  } catch (const std::exception& e) {
    TORCH_WARN("find_max_batch_size: cache ", o.cache_file, " is unreadable (", e.what(), "); searching");
  }
  return std::nullopt;
}

void store(const BatchSearchOptions& o, const BatchSearchResult& r) {
  if (o.cache_file.empty() || !r.complete) return;
  json all = json::object();
  if (std::ifstream in(o.cache_file); in) {
    try {
      all = json::parse(in);
    } catch (const std::exception&) {  // rewritten whole below
    }
  }
  all[o.cache_key] = {{"max_batch", r.max_batch}, {"recommended", r.recommended},
                      {"margin", o.margin}, {"multiple_of", o.multiple_of}, {"trials", r.trials.size()}};
  detail::write_atomically(o.cache_file, all.dump(1));
}

// The search's state: what ran, what failed, and the budget of trials and time.
class Search {
 public:
  Search(const TrialRunner& run, const BatchSearchOptions& options, const AgreeMin& agree_min)
      : run_(run), o_(options), agree_min_(agree_min), start_(std::chrono::steady_clock::now()) {}

  // Batch sizes are k * multiple_of; these helpers work in k.
  int64_t unit() const { return o_.multiple_of; }
  int64_t low_k() const { return (o_.low + unit() - 1) / unit(); }
  std::optional<int64_t> high_k() const {
    return o_.high ? std::optional<int64_t>(*o_.high / unit()) : std::nullopt;
  }
  int64_t clamp_k(int64_t k) const { return std::max(low_k(), high_k() ? std::min(k, *high_k()) : k); }

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
    const TrialOutcome outcome = run_(batch);
    const bool ok = agree(outcome.ok ? 1 : 0) == 1;
    result.trials.push_back({batch, ok, outcome.peak_bytes, outcome.seconds, phase});
    if (ok) {
      best_ok_k = k;
      ok_peaks_[k] = outcome.peak_bytes;
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

  BatchSearchResult result;
  std::optional<int64_t> best_ok_k, first_fail_k;

 private:
  std::map<int64_t, int64_t> ok_peaks_;  // measured peak of each batch that ran (in k)
  const TrialRunner& run_;
  const BatchSearchOptions& o_;
  const AgreeMin& agree_min_;
  std::chrono::steady_clock::time_point start_;
};

// The profile-seeded search. The peak of a training step is the largest of several phases' linear laws (a
// convex, piecewise-linear function of the batch); at small batches a fixed phase (optimizer state, its
// temporaries) often dominates, so memory may not grow at all there. Each step fits peak(b) on the two
// largest batches that ran and goes to the batch the fit says fills the headroom: on the final linear piece
// that is exact, so the search ends by confirming that one more fails. Guards: grow at most kGrowth-fold per
// trial (memory may not grow yet, or the fit may lie on an earlier piece: a fit that three small batches
// confirm can still break at a kink further up, so no fit is trusted beyond that); a prediction at or past
// a failed batch bisects.
void profile_seeded_search(Search& s, const BatchSearchOptions& o) {
  constexpr int64_t kGrowth = 16;
  const int64_t low = s.low_k();
  s.runs(low, "profile");
  if (!(s.high_k() && *s.high_k() <= low)) s.runs(2 * low, "profile");
  while (!s.out_of_budget()) {
    const int64_t best = *s.best_ok_k;
    if ((s.high_k() && best >= *s.high_k()) || (s.first_fail_k && *s.first_fail_k - best <= 1)) return;
    int64_t next = o.headroom_bytes > 0 ? best * kGrowth : best * 2;  // no headroom known: probe
    if (const auto fit = s.fit_two_largest(); fit && fit->per_sample_bytes > 0 && o.headroom_bytes > 0) {
      s.result.profile = fit;
      const int64_t predicted = s.agree(fit->max_batch_for(o.headroom_bytes)) / s.unit();
      next = predicted <= best ? best + 1 : std::min(predicted, next);
    }
    if (s.first_fail_k && next >= *s.first_fail_k) next = std::max(best + 1, (best + *s.first_fail_k) / 2);
    s.runs(s.clamp_k(next), "search");
  }
}

}  // namespace

BatchSearchResult search_max_batch(const TrialRunner& run, const BatchSearchOptions& o, const AgreeMin& agree_min) {
  check_options(o);
  if (const auto hit = cached(o)) {
    BatchSearchResult r;
    r.max_batch = hit->at("max_batch").get<int64_t>();
    r.recommended = hit->at("recommended").get<int64_t>();
    r.from_cache = true;
    return r;
  }
  Search s(run, o, agree_min);
  if (o.seed) {  // gallop away from the estimate: up while it runs, down while it fails
    const int64_t start_k = s.clamp_k(*o.seed / s.unit());
    if (s.runs(start_k, "search")) {
      for (int64_t step = 1; !s.first_fail_k && !s.out_of_budget(); step *= 2) {
        const int64_t k = *s.best_ok_k + step;
        if (s.high_k() && *s.best_ok_k >= *s.high_k()) break;
        s.runs(s.clamp_k(k), "search");
      }
    } else {
      for (int64_t step = 1; !s.best_ok_k && !s.out_of_budget(); step *= 2)
        s.runs(std::max(s.low_k(), start_k - step), "search");
    }
  } else if (o.profile_seed) {
    profile_seeded_search(s, o);
  } else {  // exponential probing from low
    s.runs(s.low_k(), "search");
    while (!s.first_fail_k && !(s.high_k() && *s.best_ok_k >= *s.high_k()) && !s.out_of_budget())
      s.runs(s.clamp_k(*s.best_ok_k * 2), "search");
  }
  while (s.first_fail_k && *s.first_fail_k - *s.best_ok_k > 1 && !s.out_of_budget())  // bisection
    s.runs((*s.best_ok_k + *s.first_fail_k) / 2, "search");

  TORCH_CHECK_WITH(OutOfMemoryError, s.best_ok_k.has_value(), "find_max_batch_size: max_trials (", o.max_trials,
                   ") or max_seconds (", o.max_seconds, ") ran out before any batch ran");
  BatchSearchResult& r = s.result;
  r.max_batch = *s.best_ok_k * s.unit();
  const auto margin_k = static_cast<int64_t>(static_cast<double>(r.max_batch) * (1 - o.margin)) / s.unit();
  r.recommended = std::max(s.low_k(), margin_k) * s.unit();
  store(o, r);
  return r;
}

}  // namespace gpuops
