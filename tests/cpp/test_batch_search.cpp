// Batch-size search: the exact maximum within the trial bounds (synthetic memory laws), real LibTorch training
// steps under MemoryBudget (verified independently: b runs, b+1 runs out), memory back to its baseline, errors
// that propagate or explain, ranks agreeing on the minimum, the result cache, and the profiled estimator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "gpuops/batch_search.h"
#include "gpuops/device.h"
#include "gpuops/memory_budget.h"
#include "gpuops/optimizers.h"
#include "thread_backend.h"

namespace {

// A runner for a device where batch b needs fixed + per_sample * b bytes out of `capacity`.
gpuops::TrialRunner linear_law(int64_t fixed, int64_t per_sample, int64_t capacity, int* calls = nullptr) {
  return [=](int64_t b) {
    if (calls) ++*calls;
    const int64_t peak = fixed + per_sample * b;
    return gpuops::TrialOutcome{peak <= capacity, peak, 0.0};
  };
}

int64_t ceil_log2(double x) { return x <= 1 ? 0 : static_cast<int64_t>(std::ceil(std::log2(x))); }

TEST(BatchSearch, FindsTheExactMaximumWithinTheTrialBounds) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t per_sample = 1000 + rng() % 100000, fixed = rng() % 1000000;
    const int64_t truth = 1 + rng() % 3000;
    const int64_t capacity = fixed + per_sample * truth + rng() % per_sample;  // truth fits, truth + 1 does not
    gpuops::BatchSearchOptions unseeded;
    unseeded.profile_seed = false;
    const auto probed = gpuops::search_max_batch(linear_law(fixed, per_sample, capacity), unseeded);
    EXPECT_EQ(probed.max_batch, truth);
    EXPECT_LE(static_cast<int64_t>(probed.trials.size()), 2 * ceil_log2(static_cast<double>(truth)) + 2) << truth;

    gpuops::BatchSearchOptions seeded;  // the default: two profiling trials, then from the fit's prediction
    seeded.headroom_bytes = capacity;
    const auto fitted = gpuops::search_max_batch(linear_law(fixed, per_sample, capacity), seeded);
    EXPECT_EQ(fitted.max_batch, truth);
    // Two profiling trials, growth of at most 16x per trial until the prediction is in reach, the
    // prediction (exact on a linear law) and one more to confirm.
    const int64_t growth_steps = std::max<int64_t>(0, static_cast<int64_t>(std::ceil(std::log(truth / 2.0) / std::log(16.0))) - 1);
    EXPECT_LE(static_cast<int64_t>(fitted.trials.size()), 2 + growth_steps + 2) << truth;
    ASSERT_TRUE(fitted.profile.has_value());
    EXPECT_EQ(fitted.profile->per_sample_bytes, per_sample);
  }
}

TEST(BatchSearch, HonoursMultipleOfHighMarginAndASeedFromTheEstimator) {
  const auto run = linear_law(0, 100, 100 * 203);  // the true maximum is 203
  gpuops::BatchSearchOptions o;
  o.profile_seed = false;
  o.multiple_of = 8;
  o.margin = 0.1;
  auto r = gpuops::search_max_batch(run, o);
  EXPECT_EQ(r.max_batch, 200);
  EXPECT_EQ(r.recommended, 176);  // 200 * 0.9 = 180, down to a multiple of 8
  for (const auto& t : r.trials) EXPECT_EQ(t.batch % 8, 0);
  o.high = 120;
  EXPECT_EQ(gpuops::search_max_batch(run, o).max_batch, 120);
  gpuops::BatchSearchOptions estimated;
  estimated.seed = 190;  // an analytic estimate a little low
  r = gpuops::search_max_batch(run, estimated);
  EXPECT_EQ(r.max_batch, 203);
  EXPECT_LE(static_cast<int64_t>(r.trials.size()), 2 * ceil_log2(203 - 190 + 1) + 2);  // galloping from the seed
  for (auto bad : {&gpuops::BatchSearchOptions::low, &gpuops::BatchSearchOptions::multiple_of}) {
    gpuops::BatchSearchOptions wrong;
    wrong.*bad = 0;
    EXPECT_THROW(gpuops::search_max_batch(run, wrong), c10::ValueError);
  }
  gpuops::BatchSearchOptions wrong_margin;
  wrong_margin.margin = 1.0;
  EXPECT_THROW(gpuops::search_max_batch(run, wrong_margin), c10::ValueError);
}

TEST(BatchSearch, ARankLocalLimitIsAgreedByEveryRank) {
  auto shared = std::make_shared<ThreadBackend::Shared>(3);
  int64_t found[3] = {0, 0, 0};
  auto rank = [&](int r) {
    c10::intrusive_ptr<c10d::Backend> group = c10::make_intrusive<ThreadBackend>(r, shared);
    gpuops::BatchSearchOptions o;
    o.headroom_bytes = 1000 * (50 + 20 * r);  // each rank predicts its own maximum
    const gpuops::AgreeMin agree = [group](int64_t v) {
      std::vector<at::Tensor> t{at::full({1}, v, at::kLong)};
      c10d::AllreduceOptions min;
      min.reduceOp = c10d::ReduceOp::MIN;
      group->allreduce(t, min)->wait();
      return t[0].item<int64_t>();
    };
    found[r] = gpuops::search_max_batch(linear_law(0, 1000, 1000 * (50 + 20 * r)), o, agree).max_batch;
  };
  std::thread one(rank, 1), two(rank, 2);
  rank(0);
  one.join();
  two.join();
  EXPECT_EQ(found[0], 50);
  EXPECT_EQ(found[1], 50);
  EXPECT_EQ(found[2], 50);
}

TEST(BatchSearch, CachesResultsPerKey) {
  const std::string cache = "/tmp/gpuops-batch-cache-" + std::to_string(::getpid()) + ".json";
  std::remove(cache.c_str());
  int calls = 0;
  gpuops::BatchSearchOptions o;
  o.profile_seed = false;
  o.cache_file = cache;
  o.cache_key = "cpu|mlp|float32|seq0";
  EXPECT_FALSE(gpuops::search_max_batch(linear_law(0, 10, 10 * 77, &calls), o).from_cache);
  const int first_calls = calls;
  const auto again = gpuops::search_max_batch(linear_law(0, 10, 10 * 77, &calls), o);
  EXPECT_TRUE(again.from_cache);
  EXPECT_EQ(again.max_batch, 77);
  EXPECT_EQ(calls, first_calls);
  o.cache_key = "cpu|mlp|float32|seq1";  // another key searches again
  EXPECT_FALSE(gpuops::search_max_batch(linear_law(0, 10, 10 * 50, &calls), o).from_cache);
  std::remove(cache.c_str());
}

// A real training step: an MLP with AdamW (its moments are allocated on the first step).
struct Trainer {
  torch::nn::Sequential model{torch::nn::Linear(64, 256), torch::nn::GELU(), torch::nn::Linear(256, 64)};
  gpuops::optim::AdamW optimizer{model->parameters(), gpuops::optim::AdamWOptions(1e-3)};
  void step(int64_t batch) {
    optimizer.zero_grad();
    model->forward(at::randn({batch, 64})).square().mean().backward();
    optimizer.step();
  }
};

bool runs(Trainer& t, int64_t batch) {
  try {
    t.step(batch);
    t.step(batch);
    return true;
  } catch (const c10::OutOfMemoryError&) {
    return false;
  }
}

TEST(FindMaxBatchSize, IsTheTrueMaximumUnderABudgetAndLeavesMemoryAsFound) {
  for (int64_t limit : {int64_t{3} << 20, int64_t{7} << 20}) {
    torch::manual_seed(0);
    Trainer trainer;
    trainer.step(1);  // optimizer state exists before the search, as in a resumed run
    gpuops::MemoryBudget budget(limit);
    const int64_t before = budget.current_bytes();
    const auto result = gpuops::find_max_batch_size([&](int64_t b) { trainer.step(b); });
    trainer.optimizer.zero_grad();
    EXPECT_NEAR(static_cast<double>(budget.current_bytes()), static_cast<double>(before), 0.01 * before);
    EXPECT_LE(result.trials.size(), 6u);
    EXPECT_TRUE(runs(trainer, result.max_batch)) << limit;  // verified independently
    trainer.optimizer.zero_grad();
    EXPECT_FALSE(runs(trainer, result.max_batch + 1)) << limit;
    trainer.optimizer.zero_grad();
  }
}

TEST(FindMaxBatchSize, OtherErrorsPropagateAndTheSmallestBatchFailingIsExplained) {
  gpuops::FindBatchOptions o;
  o.profile_seed = false;
  EXPECT_THROW(gpuops::find_max_batch_size(
                   [](int64_t b) { TORCH_CHECK_VALUE(b < 4, "a bug in the step at batch ", b); }, o),
               c10::ValueError);
  Trainer trainer;
  gpuops::MemoryBudget tiny(1 << 12);
  try {
    gpuops::find_max_batch_size([&](int64_t b) { trainer.step(b); }, o);
    ADD_FAILURE() << "no error";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("even the smallest batch, 1"), std::string::npos) << e.what();
  }
}

TEST(FindMaxBatchSize, WithoutABudgetOnTheCpuTheTrialsAreBoundedByNinetyPercentOfTheAvailableMemory) {
  const int64_t limit = gpuops::default_search_limit();
  ASSERT_GT(limit, 0);
  EXPECT_LE(limit, gpuops::available_host_memory_bytes());
  {
    gpuops::MemoryBudget budget(1 << 30);
    EXPECT_EQ(gpuops::default_search_limit(), gpuops::MemoryBudget::kUnlimited);
  }
  constexpr int64_t chunk = int64_t{1} << 26;  // 64 MiB a sample, never touched: only the count grows
  gpuops::FindBatchOptions o;
  o.profile_seed = false;
  o.verbose = false;
  const auto result = gpuops::find_max_batch_size([&](int64_t b) { at::empty({b * chunk}, at::kByte); }, o);
  EXPECT_NEAR(static_cast<double>(result.max_batch), static_cast<double>(limit / chunk),
              std::max(2.0, 0.05 * static_cast<double>(limit / chunk)));
}

TEST(ProfileMemory, PredictsALargerBatchAndFlagsNonLinearMemory) {
  Trainer trainer;
  trainer.step(1);
  const auto profile = gpuops::profile_memory([&](int64_t b) { trainer.step(b); }, {64, 128, 256});
  EXPECT_TRUE(profile.linear) << profile.note;
  {
    gpuops::MemoryBudget counter;
    trainer.step(192);
    trainer.step(192);
    const double measured = static_cast<double>(counter.peak_bytes());
    EXPECT_NEAR(static_cast<double>(profile.predict(192)), measured, 0.05 * measured);
  }
  // At batch 1-2 the step's peak is in a phase with a smaller slope than at 128: a third point says so.
  const auto bent = gpuops::profile_memory([&](int64_t b) { trainer.step(b); }, {1, 2, 128});
  EXPECT_FALSE(bent.linear);
  EXPECT_NE(bent.note.find("not linear"), std::string::npos);
  EXPECT_THROW(gpuops::fit_memory_profile({{4, 100}}), c10::ValueError);
}

}  // namespace
