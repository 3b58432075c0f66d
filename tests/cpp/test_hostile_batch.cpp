// Hostile input to the batch-size search (issue 10): a step whose memory never grows ends with a clear error
// (bounded by default, high= honoured, no overflow near INT64_MAX); a cache path that is a folder is refused
// before any trial and leaves nothing behind; corrupt cache entries are ignored with a warning and searched
// again; the per-allocation trace model finds a flat-then-growing peak exactly in few trials.
#include <gtest/gtest.h>

#include <climits>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "gpuops/batch_search.h"

namespace {

std::string fresh_folder(const std::string& name) {
  const std::string dir = "/tmp/gpuops-hostile-batch-" + std::to_string(::getpid()) + "-" + name;
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

// Batch b needs fixed + per_sample * b bytes out of capacity.
gpuops::TrialRunner linear_law(int64_t fixed, int64_t per_sample, int64_t capacity, int* calls) {
  return [=](int64_t b) {
    ++*calls;
    const __int128 peak = fixed + static_cast<__int128>(per_sample) * b;
    return gpuops::TrialOutcome{peak <= capacity, static_cast<int64_t>(std::min<__int128>(peak, INT64_MAX)), 0.0, {}};
  };
}

TEST(HostileBatch, AStepThatNeverRunsOutOfMemoryEndsWithAClearError) {
  int calls = 0;
  const gpuops::TrialRunner never_oom = [&](int64_t) { ++calls; return gpuops::TrialOutcome{true, 0, 0.0, {}}; };
  for (bool profile : {true, false}) {
    for (int64_t headroom : {int64_t{-1}, int64_t{180} << 20}) {
      calls = 0;
      gpuops::BatchSearchOptions o;
      o.profile_seed = profile;
      o.headroom_bytes = headroom;
      try {
        gpuops::search_max_batch(never_oom, o);
        ADD_FAILURE() << "no error";
      } catch (const c10::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("does not grow with its batch"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("high="), std::string::npos) << e.what();
      }
      EXPECT_LE(calls, 70) << profile << " " << headroom;  // log2 of the host's memory, at most
    }
  }
  calls = 0;
  gpuops::BatchSearchOptions bounded;
  bounded.high = 1000;  // the user's bound is the answer, not an error
  EXPECT_EQ(gpuops::search_max_batch(never_oom, bounded).max_batch, 1000);
  bounded.seed = 10;
  EXPECT_EQ(gpuops::search_max_batch(never_oom, bounded).max_batch, 1000);
  // The C++ front end too: a no-op step on the CPU without a budget.
  gpuops::FindBatchOptions front;
  EXPECT_THROW(gpuops::find_max_batch_size([](int64_t) {}, front), c10::ValueError);
}

TEST(HostileBatch, HighIsHonouredAndNothingOverflowsNearInt64Max) {
  std::vector<int64_t> tried;
  const gpuops::TrialRunner record = [&](int64_t b) {
    tried.push_back(b);
    return gpuops::TrialOutcome{true, 10 * b, 0.0, {}};
  };
  gpuops::BatchSearchOptions o;
  o.low = 2;
  o.high = 3;
  o.headroom_bytes = 1 << 30;
  EXPECT_EQ(gpuops::search_max_batch(record, o).max_batch, 3);
  for (int64_t b : tried) EXPECT_LE(b, 3);
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20; ++i) {  // a maximum near INT64_MAX under high = INT64_MAX: exact, no wrap-around
    int calls = 0;
    const int64_t truth = INT64_MAX / 2 + static_cast<int64_t>(rng() % (uint64_t{1} << 60));
    for (bool profile : {true, false}) {
      gpuops::BatchSearchOptions big;
      big.high = INT64_MAX;
      big.profile_seed = profile;
      EXPECT_EQ(gpuops::search_max_batch(linear_law(0, 1, truth, &calls), big).max_batch, truth);
    }
    gpuops::BatchSearchOptions seeded;
    seeded.high = INT64_MAX;
    seeded.seed = INT64_MAX - 5;
    EXPECT_EQ(gpuops::search_max_batch(linear_law(0, 1, truth, &calls), seeded).max_batch, truth);
  }
}

TEST(HostileBatch, ACacheThatIsAFolderIsRefusedBeforeAnyTrialAndLeavesNothing) {
  const std::string parent = fresh_folder("dir");
  const std::string cache = parent + "/cache.json";
  ::mkdir(cache.c_str(), 0700);
  int calls = 0;
  gpuops::BatchSearchOptions o;
  o.cache_file = cache;
  o.cache_key = "k";
  try {
    gpuops::search_max_batch(linear_law(0, 10, 1000, &calls), o);
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(names_in(parent), std::vector<std::string>{"cache.json"});
  o.cache_file = parent + "/missing/cache.json";
  EXPECT_THROW(gpuops::search_max_batch(linear_law(0, 10, 1000, &calls), o), c10::ValueError);
  EXPECT_EQ(calls, 0);
  ::rmdir(cache.c_str());
  ::rmdir(parent.c_str());
}

TEST(HostileBatch, CorruptCacheEntriesAreIgnoredWithAWarningAndSearchedAgain) {
  const std::string parent = fresh_folder("entries");
  const std::string cache = parent + "/cache.json";
  for (const std::string& text :
       {std::string(R"({"k": {"max_batch": "many", "multiple_of": 1}})"), std::string(R"({"k": {"max_batch": -5, "multiple_of": 1}})"),
        std::string(R"({"k": {"max_batch": 7.5, "multiple_of": 1}})"), std::string(R"({"k": {"max_batch": 40}})"),
        std::string(R"({"k": {"max_batch": 40, "multiple_of": "1"}})"), std::string(R"({"k": {"max_batch": 0, "multiple_of": 1}})"), std::string(R"({"k": [1, 2]})"),
        std::string(R"({"k": 12})"), std::string(R"([1, 2, 3])"), std::string(R"("text")"), std::string("{not json")}) {
    std::ofstream(cache) << text;
    int calls = 0;
    gpuops::BatchSearchOptions o;
    o.cache_file = cache;
    o.cache_key = "k";
    o.profile_seed = false;
    struct Collect : c10::WarningHandler {
      std::vector<std::string> messages;
      void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
    } collect;
    gpuops::BatchSearchResult r;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&collect);
      r = gpuops::search_max_batch(linear_law(0, 10, 10 * 77, &calls), o);
    }
    EXPECT_FALSE(r.from_cache) << text;
    EXPECT_EQ(r.max_batch, 77) << text;
    EXPECT_GT(calls, 0) << text;
    EXPECT_FALSE(collect.messages.empty()) << text;
    const auto again = gpuops::search_max_batch(linear_law(0, 10, 10 * 77, &calls), o);  // rewritten whole
    EXPECT_TRUE(again.from_cache) << text;
    EXPECT_EQ(again.max_batch, 77) << text;
  }
  std::ofstream(cache) << R"({"k": {"max_batch": 64, "multiple_of": 8, "recommended": -3}})";
  gpuops::BatchSearchOptions o;
  o.cache_file = cache;
  o.cache_key = "k";
  o.multiple_of = 8;
  o.margin = 0.25;
  int calls = 0;
  const auto hit = gpuops::search_max_batch(linear_law(0, 10, 10 * 77, &calls), o);
  EXPECT_TRUE(hit.from_cache);
  EXPECT_EQ(hit.recommended, 48);  // from this search's margin, not the file's
  o.high = 60;  // a cached maximum above this search's high is not its answer
  EXPECT_FALSE(gpuops::search_max_batch(linear_law(0, 10, 10 * 77, &calls), o).from_cache);
  std::remove(cache.c_str());
  ::rmdir(parent.c_str());
}

// A training step's memory trace: a fixed optimizer phase with a temporary that dominates at small batches,
// then activations per sample; the trial runs when no allocation passes the capacity.
gpuops::TrialRunner traced_step(int64_t weights, int64_t optimizer_temp, int64_t per_sample, int64_t capacity,
                                int* calls) {
  return [=](int64_t b) {
    ++*calls;
    std::vector<int64_t> trace;
    int64_t in_use = weights;
    for (int layer = 0; layer < 4; ++layer) trace.push_back(in_use += per_sample * b / 4);  // forward
    in_use -= per_sample * b;
    trace.push_back(in_use + weights / 2);  // gradients
    trace.push_back(in_use + weights / 2 + optimizer_temp);  // the optimizer's temporary
    int64_t peak = 0;
    for (int64_t t : trace) peak = std::max(peak, t);
    const bool ok = peak <= capacity;
    return gpuops::TrialOutcome{ok, ok ? peak : 0, 0.0, ok ? trace : std::vector<int64_t>{}};
  };
}

TEST(HostileBatch, ThePerAllocationModelFindsAFlatThenGrowingPeakExactlyInFewTrials) {
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) {
    const int64_t per_sample = 4 * (100 + rng() % 5000), weights = 1000000 + rng() % 1000000;
    const int64_t temp = weights / 2 + rng() % 1000000;
    const int64_t capacity = weights + weights / 2 + temp + per_sample * (50 + rng() % 3000);
    int64_t truth = 0;
    int calls = 0;
    for (int64_t b = 1;; ++b) {  // the true maximum, by brute force
      if (!traced_step(weights, temp, per_sample, capacity, &calls)(b).ok) break;
      truth = b;
    }
    calls = 0;
    gpuops::BatchSearchOptions o;
    o.headroom_bytes = capacity;
    const auto r = gpuops::search_max_batch(traced_step(weights, temp, per_sample, capacity, &calls), o);
    EXPECT_EQ(r.max_batch, truth);
    EXPECT_LE(r.trials.size(), 4u) << truth;  // two profiles, the prediction, one more to confirm
  }
}

}  // namespace
