// Hostile input to every public C++ entry point of the LibTorch glue (issue 10): careless arguments (undefined,
// empty, mismatched, integer, non-contiguous, out-of-range, non-finite) get a c10::ValueError naming the argument,
// and a refused call changes nothing. Probes that could crash the process (overflow, huge allocations, signal
// handlers, undefined behaviour) run in a child (EXPECT_EXIT), so a crash fails one test, not the suite.
#include <gtest/gtest.h>

#include <climits>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/sgd.h>

#include "gpuops/amp.h"
#include "gpuops/autocast.h"
#include "gpuops/batch_search.h"
#include "gpuops/checkpoint.h"
#include "gpuops/checkpoint_policy.h"
#include "gpuops/checkpointed_sequential.h"
#include "gpuops/device.h"
#include "gpuops/flat_params.h"
#include "gpuops/fused_adam.h"
#include "gpuops/fused_sgd.h"
#include "gpuops/grad_accumulator.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/memory_budget.h"
#include "gpuops/optimizers.h"
#include "gpuops/training_state.h"

namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// What a call threw: "" for nothing, else "<kind>: <message>" (kind: ValueError, OutOfMemoryError, Error, std).
std::string thrown(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return std::string("ValueError: ") + e.what_without_backtrace();
  } catch (const c10::OutOfMemoryError& e) {
    return std::string("OutOfMemoryError: ") + e.what_without_backtrace();
  } catch (const c10::Error& e) {
    return std::string("Error: ") + e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("std: ") + e.what();
  }
  return "";
}

// The call raises c10::ValueError whose message holds every fragment.
void expect_value_error(const std::function<void()>& fn, std::initializer_list<const char*> fragments) {
  const std::string got = thrown(fn);
  EXPECT_EQ(got.rfind("ValueError: ", 0), 0u) << "got: " << (got.empty() ? "no error" : got);
  for (const char* f : fragments) EXPECT_NE(got.find(f), std::string::npos) << "missing '" << f << "' in: " << got;
}

// For EXPECT_EXIT: runs fn in the child, prints what it threw and exits 0 (a crash or a hang fails the test).
[[noreturn]] void report_and_exit(const std::function<void()>& fn) {
  const std::string got = thrown(fn);
  std::fprintf(stderr, "outcome=[%s]\n", got.empty() ? "none" : got.c_str());
  std::fflush(stderr);
  std::_Exit(0);
}

at::Tensor leaf(std::vector<int64_t> shape = {3}, at::ScalarType dtype = at::kFloat) {
  return at::randn(shape, at::TensorOptions().dtype(dtype)).requires_grad_(true);
}
at::Tensor flag() { return at::zeros({1}); }
at::Tensor one() { return at::ones({1}); }

class HostileApi : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

// ---------------------------------------------------------------- memory_budget.h

TEST_F(HostileApi, MemoryBudgetRefusesBadLimitsAndDevices) {
  for (int64_t limit : {int64_t{0}, int64_t{-2}, INT64_MIN})
    expect_value_error([&] { gpuops::MemoryBudget b(limit); }, {"limit_bytes", std::to_string(limit).c_str()});
  expect_value_error([] { gpuops::MemoryBudget b(100, c10::Device(c10::kMeta)); }, {"device", "meta"});
  expect_value_error([] { gpuops::memory_headroom_bytes(c10::Device(c10::kMeta)); }, {"device", "meta"});
  // A CUDA ordinal this process does not have (none on a CPU machine), with and without an index.
  expect_value_error([] { gpuops::MemoryBudget b(100, c10::Device(c10::kCUDA, 7)); }, {"MemoryBudget", "7"});
  expect_value_error([] { gpuops::memory_headroom_bytes(c10::Device(c10::kCUDA, 7)); }, {"memory_headroom_bytes", "7"});
}

TEST_F(HostileApi, MemoryBudgetOnCudaWithoutAGpuSaysSo) {
  if (at::hasCUDA()) GTEST_SKIP() << "a CUDA device is visible";
  expect_value_error([] { gpuops::MemoryBudget b(100, c10::Device(c10::kCUDA)); }, {"MemoryBudget", "cuda"});
  expect_value_error([] { gpuops::memory_headroom_bytes(c10::Device(c10::kCUDA)); }, {"memory_headroom_bytes", "cuda"});
}

TEST_F(HostileApi, MemoryBudgetTracesAndNestingInAnyOrder) {
  {
    gpuops::MemoryBudget b;
    EXPECT_TRUE(b.take_trace().empty());  // never started
    b.start_trace();
    b.start_trace();  // twice: one trace
    auto t = at::empty({1000});
    EXPECT_EQ(b.take_trace().size(), 1u);
    EXPECT_TRUE(b.take_trace().empty());
  }
  // Budgets ended out of order (held in unique_ptrs): afterwards nothing is limited or counted.
  auto outer = std::make_unique<gpuops::MemoryBudget>(1 << 20);
  auto inner = std::make_unique<gpuops::MemoryBudget>(1 << 22);
  EXPECT_EQ(thrown([] { at::empty({1 << 19}); }).rfind("OutOfMemoryError", 0), 0u);  // 2 MiB > outer's 1 MiB
  outer.reset();
  EXPECT_EQ(thrown([] { at::empty({1 << 19}); }), "");  // only the inner 4 MiB remains
  inner.reset();
  EXPECT_EQ(gpuops::memory_headroom_bytes(), -1);
  EXPECT_EQ(thrown([] { at::empty({1 << 21}); }), "");
}

// ---------------------------------------------------------------- device.h

TEST_F(HostileApi, LocalRankAndDeviceIndexAreChecked) {
  for (const char* bad : {"", "-1", "abc", "1.5", "3 ", "99999999999", "0x10"})
    expect_value_error([&] { gpuops::parse_local_rank(std::string(bad)); }, {"LOCAL_RANK", bad});
  EXPECT_EQ(gpuops::parse_local_rank(std::nullopt), std::nullopt);
  EXPECT_EQ(gpuops::parse_local_rank(std::string("7")), 7);
  EXPECT_EQ(gpuops::device_index_for_local_rank(std::string("5"), 1), 0);  // one pinned GPU per process
  expect_value_error([] { gpuops::device_index_for_local_rank(std::string("2"), 2); }, {"LOCAL_RANK=2"});
  for (int count : {-1, -5})
    expect_value_error([&] { gpuops::device_index_for_local_rank(std::string("0"), count); },
                       {"device_count", std::to_string(count).c_str()});
  expect_value_error([] { gpuops::device_info(-1); }, {"index", "-1"});
  expect_value_error([] { gpuops::device_info(1000); }, {"index", "1000"});
}

TEST_F(HostileApi, DeviceInfoWithAMalformedLocalRankInTheEnvironment) {
  EXPECT_EXIT(report_and_exit([] {
                ::setenv("LOCAL_RANK", "banana", 1);
                gpuops::device_info();
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[ValueError: LOCAL_RANK must be .*banana");
}

// ---------------------------------------------------------------- amp.h

TEST_F(HostileApi, UnscaleAndCheckRefusesBadStateAndGradients) {
  using gpuops::amp::unscale_and_check_;
  auto g = at::randn({4});
  expect_value_error([&] { unscale_and_check_({g}, at::Tensor(), one()); }, {"found_inf"});
  expect_value_error([&] { unscale_and_check_({g}, at::zeros({1}, at::kInt), one()); }, {"found_inf", "Float"});
  expect_value_error([&] { unscale_and_check_({g}, at::zeros({2}), one()); }, {"found_inf", "2 elements"});
  expect_value_error([&] { unscale_and_check_({g}, flag(), at::Tensor()); }, {"inv_scale", "undefined"});
  expect_value_error([&] { unscale_and_check_({g}, flag(), at::ones({1}, at::kDouble)); }, {"inv_scale"});
  expect_value_error([&] { unscale_and_check_({g}, flag(), at::ones({}, at::kFloat).to(c10::kMeta)); }, {"inv_scale"});
  expect_value_error([&] { unscale_and_check_({g, at::Tensor()}, flag(), one()); }, {"grads[1]", "undefined"});
  expect_value_error([&] { unscale_and_check_({at::ones({3}, at::kInt)}, flag(), one()); }, {"grads[0]", "Int"});
  // (float64 and strided views go to torch's kernel, as torch's scaler takes them; overlapping memory cannot)
  expect_value_error([&] { unscale_and_check_({g, at::randn({1, 4}).expand({3, 4})}, flag(), one()); },
                     {"grads[1]", "expanded"});
  expect_value_error([&] { unscale_and_check_({at::randn({4}).to_sparse()}, flag(), one()); }, {"grads[0]", "sparse"});
  EXPECT_TRUE(at::equal(g, g.clone()));  // refused calls wrote nothing
}

TEST_F(HostileApi, UnscaleAndCheckEdgeShapesGiveTheReference) {
  using gpuops::amp::unscale_and_check_;
  auto found = flag();
  unscale_and_check_({}, found, one());  // an empty list: nothing to do
  EXPECT_EQ(found.item<float>(), 0.0f);
  auto empty = at::empty({0, 3});
  auto t = at::randn({5, 7}).t();  // transposed: dense, non-overlapping
  const auto expected = t * 0.25;
  unscale_and_check_({empty, t}, found, at::full({1}, 0.25f));
  EXPECT_TRUE(at::allclose(t, expected));
  EXPECT_EQ(found.item<float>(), 0.0f);
}

TEST_F(HostileApi, AScaleThatIsNotFiniteRaisesTheOverflowFlag) {
  // A non-finite inverse scale turns finite gradients into inf/nan: the step must be skipped, not applied.
  for (float inv : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    auto found = flag();
    auto g = at::randn({40});
    gpuops::amp::unscale_and_check_({g}, found, at::full({1}, inv));
    EXPECT_EQ(found.item<float>(), 1.0f) << "inv_scale " << inv;
    auto found_norm = flag();
    gpuops::amp::unscaled_grad_norm_({at::randn({40})}, at::full({1}, inv), found_norm);
    EXPECT_EQ(found_norm.item<float>(), 1.0f) << "inv_scale " << inv;
  }
}

TEST_F(HostileApi, UnscaledGradNormChecksLikeUnscaleAndNormsAnEmptyListToZero) {
  using gpuops::amp::unscaled_grad_norm_;
  expect_value_error([] { unscaled_grad_norm_({at::randn({3})}, one(), at::Tensor()); }, {"found_inf"});
  expect_value_error([] { unscaled_grad_norm_({at::randn({3})}, at::ones({1}, at::kHalf), flag()); }, {"inv_scale"});
  expect_value_error([] { unscaled_grad_norm_({at::ones({3}, at::kLong)}, one(), flag()); }, {"grads[0]", "Long"});
  auto found = flag();
  EXPECT_EQ(unscaled_grad_norm_({}, one(), found).item<float>(), 0.0f);
  auto g = at::randn({100});
  EXPECT_NEAR(unscaled_grad_norm_({g, at::empty({0})}, at::full({1}, 0.5f), found).item<float>(),
              (g * 0.5).norm().item<float>(), 1e-4);
}

TEST_F(HostileApi, UpdateScaleRefusesBadStateAndOptionsBeforeWriting) {
  using gpuops::amp::update_scale_;
  auto scale = at::full({1}, 8.0f), tracker = at::zeros({1}, at::kInt), hyst = at::ones({1}, at::kInt);
  gpuops::amp::ScaleUpdateOptions o;
  expect_value_error([&] { update_scale_(at::Tensor(), tracker, hyst, flag(), o); }, {"scale"});
  expect_value_error([&] { update_scale_(scale, tracker.to(at::kFloat), hyst, flag(), o); }, {"growth_tracker"});
  expect_value_error([&] { update_scale_(scale, tracker, at::ones({2}, at::kInt), flag(), o); }, {"hysteresis_left"});
  expect_value_error([&] { update_scale_(scale, tracker, hyst, at::zeros({1}, at::kInt), o); }, {"found_inf"});
  struct Bad {
    const char* name;
    std::function<void(gpuops::amp::ScaleUpdateOptions&)> set;
  };
  const Bad bad[] = {
      {"growth_factor", [](auto& x) { x.growth_factor = kNan; }},
      {"growth_factor", [](auto& x) { x.growth_factor = kInf; }},
      {"growth_factor", [](auto& x) { x.growth_factor = 1.0; }},
      {"backoff_factor", [](auto& x) { x.backoff_factor = kNan; }},
      {"backoff_factor", [](auto& x) { x.backoff_factor = 1.0; }},
      {"growth_interval", [](auto& x) { x.growth_interval = 0; }},
      {"growth_interval", [](auto& x) { x.growth_interval = int64_t{1} << 31; }},
      {"hysteresis", [](auto& x) { x.hysteresis = 0; }},
      {"min_scale", [](auto& x) { x.min_scale = kNan; }},
      {"min_scale", [](auto& x) { x.min_scale = kInf; }},
      {"min_scale", [](auto& x) { x.min_scale = -1.0; }},
      {"max_scale", [](auto& x) { x.max_scale = kNan; }},
      {"max_scale", [](auto& x) { x.max_scale = 1e300; }},
      {"max_scale", [](auto& x) { x.min_scale = 4; x.max_scale = 2; }},
  };
  for (const auto& b : bad) {
    gpuops::amp::ScaleUpdateOptions x;
    b.set(x);
    expect_value_error([&] { update_scale_(scale, tracker, hyst, at::ones({1}), x); }, {b.name});
  }
  EXPECT_EQ(scale.item<float>(), 8.0f);  // nothing written by a refused call
  EXPECT_EQ(hyst.item<int>(), 1);
}

// ---------------------------------------------------------------- autocast.h

TEST_F(HostileApi, AutocastGuardRefusesBadDtypesAndDevicesAndRestoresInAnyOrder) {
  const bool before = at::autocast::is_autocast_enabled(c10::kCPU);
  for (auto dtype : {c10::kFloat, c10::kDouble, c10::kInt})
    expect_value_error([&] { gpuops::amp::AutocastGuard g(c10::kCPU, dtype); }, {"dtype"});
  expect_value_error([] { gpuops::amp::AutocastGuard g(c10::kMeta); }, {"device_type", "META"});
  EXPECT_EQ(at::autocast::is_autocast_enabled(c10::kCPU), before);  // a refused guard changed nothing
  {
    auto a = std::make_unique<gpuops::amp::AutocastGuard>(c10::kCPU, c10::kBFloat16);
    auto b = std::make_unique<gpuops::amp::AutocastGuard>(c10::kCPU, c10::kHalf, /*enabled=*/false);
    auto c = std::make_unique<gpuops::amp::AutocastGuard>(c10::kCUDA, c10::kHalf);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
    a.reset();
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));  // b is still in force
    c.reset();
    b.reset();
  }
  EXPECT_EQ(at::autocast::is_autocast_enabled(c10::kCPU), before);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCUDA));
}

// ---------------------------------------------------------------- fused_adam.h / fused_sgd.h

struct AdamLists {
  std::vector<at::Tensor> params, grads, m, v, vmax, steps;
  explicit AdamLists(int n) {
    for (int i = 0; i < n; ++i) {
      params.push_back(at::randn({5}));
      grads.push_back(at::randn({5}));
      m.push_back(at::zeros({5}));
      v.push_back(at::zeros({5}));
      vmax.push_back(at::zeros({5}));
      steps.push_back(at::zeros({}));
    }
  }
  void step(const gpuops::optim::AdamStepOptions& o = {}, std::optional<at::Tensor> scale = std::nullopt,
            std::optional<at::Tensor> found = std::nullopt) {
    gpuops::optim::adam_step_(params, grads, m, v, vmax, steps, o, scale, found);
  }
};

TEST_F(HostileApi, AdamStepRefusesMismatchedListsAndTensorsBeforeWriting) {
  AdamLists l(2);
  const auto before = l.params[0].clone();
  auto refuse = [&](const std::function<void(AdamLists&)>& spoil, std::initializer_list<const char*> fragments) {
    AdamLists x = l;
    spoil(x);
    expect_value_error([&] { x.step(); }, fragments);
    EXPECT_TRUE(at::equal(l.params[0], before));
    EXPECT_EQ(l.steps[0].item<float>(), 0.0f);
  };
  refuse([](AdamLists& x) { x.grads.pop_back(); }, {"grads has 1 tensors but params has 2"});
  refuse([](AdamLists& x) { x.m.clear(); }, {"exp_avgs"});
  refuse([](AdamLists& x) { x.steps.push_back(at::zeros({})); }, {"steps has 3"});
  refuse([](AdamLists& x) { x.steps[1] = at::Tensor(); }, {"steps[1]"});
  refuse([](AdamLists& x) { x.steps[1] = at::zeros({}, at::kLong); }, {"steps[1]", "float32"});
  refuse([](AdamLists& x) { x.steps[1] = at::zeros({2}); }, {"steps[1]", "one-element"});
  refuse([](AdamLists& x) { x.v[1] = at::Tensor(); }, {"exp_avg_sqs[1]"});
  refuse([](AdamLists& x) { x.m[1] = at::zeros({4}); }, {"exp_avgs[1]", "sizes"});
  refuse([](AdamLists& x) { x.params[1] = at::ones({5}, at::kInt); }, {"params[1]", "Int"});
  refuse([](AdamLists& x) { x.grads[1] = at::ones({5}, at::kDouble); }, {"grads[1]", "Double"});
  refuse([](AdamLists& x) { x.grads[0] = at::randn({5}).to_sparse(); }, {"grads[0]", "sparse"});
  refuse([](AdamLists& x) { x.params[0] = at::randn({10}).slice(0, 0, 10, 2); }, {"params[0]", "non-overlapping"});
  // The same tensor twice would be stepped twice in one call.
  refuse([](AdamLists& x) { x.params[1] = x.params[0]; }, {"params[1]", "params[0]"});
  refuse([](AdamLists& x) { x.m[1] = x.m[0]; }, {"exp_avgs[1]"});
}

TEST_F(HostileApi, AdamStepRefusesBadScalars) {
  AdamLists l(1);
  const auto before = l.params[0].clone();
  expect_value_error([&] { l.step({}, at::Tensor()); }, {"grad_scale"});
  expect_value_error([&] { l.step({}, std::nullopt, at::Tensor()); }, {"found_inf"});
  expect_value_error([&] { l.step({}, at::ones({1}, at::kInt)); }, {"grad_scale"});
  expect_value_error([&] { l.step({}, std::nullopt, at::zeros({3})); }, {"found_inf"});
  gpuops::optim::AdamStepOptions o;
  o.lr_tensor = at::Tensor();
  expect_value_error([&] { l.step(o); }, {"lr"});
  o.lr_tensor = at::ones({1}, at::kDouble);
  expect_value_error([&] { l.step(o); }, {"lr"});
  o = {};
  o.amsgrad = true;
  l.vmax.clear();
  expect_value_error([&] { l.step(o); }, {"max_exp_avg_sqs"});
  EXPECT_TRUE(at::equal(l.params[0], before));
}

TEST_F(HostileApi, AdamStepOnZeroSizeAndEmptyListsAndUnderAFlag) {
  AdamLists empty(0);
  empty.step();  // nothing to do
  AdamLists l(1);
  l.params[0] = at::empty({0});
  l.grads[0] = at::empty({0});
  l.m[0] = at::empty({0});
  l.v[0] = at::empty({0});
  l.step();
  EXPECT_EQ(l.steps[0].item<float>(), 1.0f);
  AdamLists f(1);
  const auto before = f.params[0].clone();
  f.step({}, std::nullopt, at::ones({1}));
  EXPECT_TRUE(at::equal(f.params[0], before));
  EXPECT_EQ(f.steps[0].item<float>(), 0.0f);
}

TEST_F(HostileApi, AdamMasterStepRefusesWrongSides) {
  using gpuops::optim::adam_step_master_;
  std::vector<at::Tensor> p{at::randn({4}).to(at::kHalf)}, g{at::randn({4}).to(at::kHalf)}, master{p[0].to(at::kFloat)},
      m{at::zeros({4})}, v{at::zeros({4})}, steps{at::zeros({})};
  const auto before = p[0].clone();
  auto call = [&](std::vector<at::Tensor> pp, std::vector<at::Tensor> gg, std::vector<at::Tensor> mm) {
    adam_step_master_(pp, gg, mm, m, v, {}, steps, {}, std::nullopt, std::nullopt);
  };
  expect_value_error([&] { call({at::randn({4})}, g, master); }, {"params[0]", "float16 or bfloat16"});
  expect_value_error([&] { call(p, {at::randn({4}).to(at::kBFloat16)}, master); }, {"grads[0]", "dtype"});
  expect_value_error([&] { call(p, {}, master); }, {"grads (0)"});
  expect_value_error([&] { call({at::Tensor()}, g, master); }, {"params[0]"});
  expect_value_error([&] { call(p, g, {at::Tensor()}); }, {"params[0]"});
  expect_value_error([&] { call(p, {at::randn({2}).to(at::kHalf)}, master); }, {"grads[0]"});
  EXPECT_TRUE(at::equal(p[0], before));
}

TEST_F(HostileApi, SgdStepRefusesBadListsAndOptions) {
  using gpuops::optim::sgd_step_;
  std::vector<at::Tensor> p{at::randn({4})}, g{at::randn({4})}, steps{at::zeros({})};
  const auto before = p[0].clone();
  gpuops::optim::SgdStepOptions o;
  o.momentum = 0.9;
  expect_value_error([&] { sgd_step_(p, g, {}, steps, o, std::nullopt, std::nullopt); }, {"momentum_buffers"});
  expect_value_error([&] { sgd_step_(p, g, {at::Tensor()}, steps, o, std::nullopt, std::nullopt); },
                     {"momentum_buffers[0]"});
  o.nesterov = true;
  o.momentum = 0;
  expect_value_error([&] { sgd_step_(p, g, {}, steps, o, std::nullopt, std::nullopt); }, {"Nesterov"});
  o = {};
  o.dampening = kNan;
  expect_value_error([&] { sgd_step_(p, g, {}, steps, o, std::nullopt, std::nullopt); }, {"dampening"});
  o = {};
  expect_value_error([&] { sgd_step_(p, {p[0]}, {}, {at::zeros({}), at::zeros({})}, o, std::nullopt, std::nullopt); },
                     {"steps has 2"});
  expect_value_error([&] { sgd_step_({p[0], p[0]}, {g[0], g[0]}, {}, {steps[0], at::zeros({})}, o, std::nullopt,
                                     std::nullopt); },
                     {"params[1]"});
  expect_value_error([&] { gpuops::optim::sgd_step_master_(p, g, p, {}, steps, o, std::nullopt, std::nullopt); },
                     {"params[0]", "float16 or bfloat16"});
  EXPECT_TRUE(at::equal(p[0], before));
}

// ---------------------------------------------------------------- optimizers.h

TEST_F(HostileApi, OptimizersWithoutParametersOrGradientsDoNothing) {
  gpuops::optim::AdamW empty(std::vector<at::Tensor>{});
  empty.step();
  auto w = leaf();
  const auto before = w.detach().clone();
  gpuops::optim::AdamW adamw({w});
  adamw.step();  // no gradient: not stepped, no state
  EXPECT_TRUE(at::equal(w, before));
  EXPECT_TRUE(adamw.state().empty());
  gpuops::optim::SGD sgd({w}, gpuops::optim::SGDOptions(0.1).momentum(0.9));
  sgd.step();
  EXPECT_TRUE(at::equal(w, before));
}

TEST_F(HostileApi, AStepRefusedInOneGroupChangesNoGroup) {
  // Group 0 is fine; group 1's gradient is sparse, of another dtype or another shape: the refusal must come
  // before group 0 is stepped. (A gradient laid out otherwise than its parameter is stepped, as torch's
  // optimizers step it: FusedOptimizers.StridedParametersAndGradientsStepAsTorchs.)
  const std::vector<std::function<void(at::Tensor&)>> spoil = {
      [](at::Tensor& q) { q.mutable_grad() = at::randn({4, 3}).to_sparse(); },
      [](at::Tensor& q) { q.mutable_grad() = at::randn({4, 3}, at::kDouble); },
      [](at::Tensor& q) { q.mutable_grad() = at::randn({12}); },
  };
  for (size_t k = 0; k < spoil.size(); ++k) {
    for (int which = 0; which < 2; ++which) {
      auto p = leaf({5}), q = leaf({4, 3});
      p.mutable_grad() = at::randn({5});
      spoil[k](q);
      const auto p0 = p.detach().clone(), q0 = q.detach().clone();
      std::vector<torch::optim::OptimizerParamGroup> groups{torch::optim::OptimizerParamGroup({p}),
                                                            torch::optim::OptimizerParamGroup({q})};
      std::unique_ptr<torch::optim::Optimizer> opt;
      if (which == 0) opt = std::make_unique<gpuops::optim::AdamW>(groups);
      else opt = std::make_unique<gpuops::optim::SGD>(groups, gpuops::optim::SGDOptions(0.1).momentum(0.9));
      expect_value_error([&] { opt->step(); }, {"param_groups[1]"});
      EXPECT_TRUE(at::equal(p, p0)) << "case " << k << " optimizer " << which << ": group 0 was stepped";
      EXPECT_TRUE(at::equal(q, q0));
      EXPECT_TRUE(opt->state().empty()) << "case " << k << " optimizer " << which << ": state was created";
    }
  }
}

TEST_F(HostileApi, AParamGroupWithAnotherOptimizersOptionsIsRefused) {
  EXPECT_EXIT(report_and_exit([] {
                auto p = leaf(), q = leaf();
                gpuops::optim::AdamW adamw({p});
                adamw.add_param_group(
                    torch::optim::OptimizerParamGroup({q}, std::make_unique<gpuops::optim::SGDOptions>(0.1)));
                q.mutable_grad() = at::randn({3});
                adamw.step();
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[ValueError: AdamW: param_groups\\[1\\] .*options");
  EXPECT_EXIT(report_and_exit([] {
                auto p = leaf(), q = leaf();
                gpuops::optim::SGD sgd({p}, 0.1);
                sgd.add_param_group(
                    torch::optim::OptimizerParamGroup({q}, std::make_unique<torch::optim::SGDOptions>(0.1)));
                q.mutable_grad() = at::randn({3});
                sgd.step();
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[ValueError: SGD: param_groups\\[1\\] .*options");
}

TEST_F(HostileApi, AddedGroupsAndChangedOptionsAreCheckedAtTheStep) {
  auto p = leaf(), q = leaf();
  gpuops::optim::AdamW adamw({p});
  adamw.add_param_group(torch::optim::OptimizerParamGroup({q, p}));  // p again
  p.mutable_grad() = at::randn({3});
  const auto p0 = p.detach().clone();
  expect_value_error([&] { adamw.step(); }, {"listed twice"});
  EXPECT_TRUE(at::equal(p, p0));
  gpuops::optim::SGD sgd({q}, gpuops::optim::SGDOptions(0.1));
  q.mutable_grad() = at::randn({3});
  sgd.param_groups()[0].options().set_lr(kNan);
  const auto q0 = q.detach().clone();
  expect_value_error([&] { sgd.step(); }, {"param_groups[0]", "learning rate: nan"});
  EXPECT_TRUE(at::equal(q, q0));
}

TEST_F(HostileApi, StepScaledRefusesBadScalarsAndChangesNothing) {
  auto p = leaf();
  p.mutable_grad() = at::randn({3});
  gpuops::optim::AdamW adamw({p});
  const auto p0 = p.detach().clone();
  expect_value_error([&] { adamw.step_scaled(at::ones({1}, at::kInt), std::nullopt); }, {"grad_scale"});
  expect_value_error([&] { adamw.step_scaled(std::nullopt, at::zeros({2})); }, {"found_inf"});
  expect_value_error([&] { adamw.step_scaled(at::Tensor(), std::nullopt); }, {"grad_scale"});
  EXPECT_TRUE(at::equal(p, p0));
  EXPECT_TRUE(adamw.state().empty());
}

// ---------------------------------------------------------------- grad_scaler.h

TEST_F(HostileApi, GradScalerCallOrderIsEnforcedWithClearErrors) {
  using gpuops::amp::GradScaler;
  auto w = leaf();
  gpuops::optim::SGD sgd({w}, gpuops::optim::SGDOptions(0.1));
  GradScaler scaler;
  expect_value_error([&] { scaler.scale(at::Tensor()); }, {"loss"});
  EXPECT_NE(thrown([&] { scaler.unscale_(sgd); }).find("before any scale()"), std::string::npos);
  EXPECT_NE(thrown([&] { scaler.update(); }).find("before any scale()"), std::string::npos);
  auto loss = scaler.scale(w.sum());
  EXPECT_NE(thrown([&] { scaler.step(sgd); }).find("no gradients"), std::string::npos);
  loss.backward();
  for (double bad : {0.0, -1.0, kNan})
    expect_value_error([&] { scaler.clip_grad_norm_(sgd, bad); }, {"max_norm"});
  expect_value_error([&] { scaler.set_grad_divisor(sgd, at::ones({2})); }, {"divisor"});
  expect_value_error([&] { scaler.set_grad_divisor(sgd, at::ones({1}, at::kBool)); }, {"divisor"});
  expect_value_error([&] { scaler.set_grad_divisor(sgd, at::Tensor()); }, {"divisor"});
  scaler.unscale_(sgd);
  EXPECT_NE(thrown([&] { scaler.unscale_(sgd); }).find("already called"), std::string::npos);
  EXPECT_NE(thrown([&] { scaler.set_grad_divisor(sgd, at::ones({1})); }).find("must come before"), std::string::npos);
  EXPECT_NE(thrown([&] { scaler.clip_grad_norm_(sgd, 1.0); }).find("right after backward"), std::string::npos);
  const auto before = w.detach().clone();
  scaler.step(sgd);
  EXPECT_NE(thrown([&] { scaler.step(sgd); }).find("already called"), std::string::npos);
  scaler.update();
  EXPECT_TRUE(at::allclose(w, before - 0.1));
  EXPECT_NE(thrown([&] { scaler.update(); }).find("no unscale_() or step()"), std::string::npos);
}

TEST_F(HostileApi, ADisabledScalerIsATransparentPassThrough) {
  gpuops::amp::GradScalerOptions o;
  o.enabled = false;
  gpuops::amp::GradScaler scaler(o);
  auto w = leaf();
  gpuops::optim::SGD sgd({w}, gpuops::optim::SGDOptions(0.1));
  auto loss = w.sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  // A divisor on a disabled scaler still divides (what the accumulator relies on) or is refused naming why.
  const std::string divisor = thrown([&] { scaler.set_grad_divisor(sgd, at::full({1}, 2.0)); });
  EXPECT_TRUE(divisor.empty() || divisor.find("disabled") != std::string::npos) << divisor;
  const auto before = w.detach().clone();
  scaler.unscale_(sgd);
  scaler.step(sgd);
  scaler.update();
  EXPECT_TRUE(at::allclose(w, before - (divisor.empty() ? 0.05 : 0.1)));
  EXPECT_TRUE(scaler.state_dict().empty());
  scaler.load_state_dict({});
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST_F(HostileApi, GradScalerLoadWithMissingKeysChangesNothing) {
  gpuops::amp::GradScaler scaler;
  const auto before = scaler.state_dict();
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    auto state = before;
    state.erase(key);
    expect_value_error([&] { scaler.load_state_dict(state); }, {key});
    EXPECT_EQ(scaler.state_dict(), before);
  }
  expect_value_error([&] { scaler.load_state_dict({}); }, {"empty"});
  expect_value_error([] { gpuops::amp::check_positive_count(at::full({1}, kInf), "here", "n"); }, {"here", "n"});
}

// ---------------------------------------------------------------- grad_accumulator.h

TEST_F(HostileApi, GradAccumulatorRefusesBadMicroBatchesWithoutMoving) {
  auto w = leaf();
  gpuops::optim::SGD sgd({w}, gpuops::optim::SGDOptions(0.1));
  gpuops::GradAccumulator acc(sgd, {2});
  expect_value_error([&] { acc.backward(at::Tensor(), 1.0); }, {"loss_sum", "undefined"});
  expect_value_error([&] { acc.backward(w * 2, 1.0); }, {"loss_sum", "one floating value"});
  expect_value_error([&] { acc.backward(w.sum().detach(), 1.0); }, {"loss_sum", "require grad"});
  expect_value_error([&] { acc.backward(w.sum(), at::ones({1}, at::kBool)); }, {"count"});
  expect_value_error([&] { acc.backward(w.sum(), at::Tensor()); }, {"count"});
  expect_value_error([&] { acc.backward(w.sum(), at::ones({2})); }, {"count"});
  EXPECT_EQ(acc.micro_batches(), 0);
  EXPECT_FALSE(w.grad().defined());
  EXPECT_FALSE(acc.flush());
}

TEST_F(HostileApi, AThrowingBoundaryHookLeavesTheWindowToRetry) {
  auto w = leaf();
  gpuops::optim::SGD sgd({w}, gpuops::optim::SGDOptions(0.1));
  gpuops::GradAccumulatorOptions o;
  o.window = 1;
  bool fail = true;
  o.on_boundary = [&] {
    if (fail) throw std::runtime_error("reduce failed");
  };
  gpuops::GradAccumulator acc(sgd, o);
  const auto before = w.detach().clone();
  EXPECT_EQ(thrown([&] { acc.backward(w.sum(), 4.0); }), "std: reduce failed");
  EXPECT_TRUE(at::equal(w, before));
  fail = false;
  EXPECT_TRUE(acc.flush());  // the window is still there; its count too
  EXPECT_TRUE(at::allclose(w, before - 0.1 / 4));
  EXPECT_EQ(acc.micro_batches(), 0);
}

// ---------------------------------------------------------------- checkpoint.h

TEST_F(HostileApi, CheckpointRefusesAnEmptyFunctionAndUndefinedBuffers) {
  auto x = leaf();
  expect_value_error([&] { gpuops::checkpoint(gpuops::SegmentFn(), {x}); }, {"fn"});
  expect_value_error([&] { gpuops::checkpoint(std::function<at::Tensor(const at::Tensor&)>(), x); }, {"fn"});
  gpuops::CheckpointOptions o;
  o.buffers = {at::Tensor()};
  expect_value_error([&] { gpuops::checkpoint([](const at::Tensor& t) { return t * 2; }, x, o); }, {"buffers[0]"});
  // No input requiring grad: torch's reentrant checkpoint warns and its outputs need no grad; so does ours.
  const auto y = gpuops::checkpoint([](const at::Tensor& t) { return t * 2; }, at::randn({3}));
  EXPECT_FALSE(y.requires_grad());
}

TEST_F(HostileApi, CheckpointOfOddSegmentsKeepsGradientsRight) {
  auto x = leaf(), w = leaf();
  // No outputs; an undefined output; an integer output; an input passed through; an undefined input.
  EXPECT_TRUE(gpuops::checkpoint([](const std::vector<at::Tensor>&) { return std::vector<at::Tensor>{}; }, {x}).empty());
  auto outs = gpuops::checkpoint(
      [&](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::Tensor(), in[0].to(at::kLong), in[0], in[0] * w};
      },
      {x, at::Tensor()});
  ASSERT_EQ(outs.size(), 4u);
  EXPECT_FALSE(outs[0].defined());
  EXPECT_FALSE(outs[1].requires_grad());
  (outs[2].sum() + outs[3].sum()).backward();
  EXPECT_TRUE(at::allclose(x.grad(), 1 + w.detach()));
  EXPECT_TRUE(at::allclose(w.grad(), x.detach()));
}

TEST_F(HostileApi, ASegmentThatThrowsInItsForwardChangesNothing) {
  auto x = leaf();
  at::manual_seed(3);
  const auto expected = at::rand({4});
  at::manual_seed(3);
  EXPECT_EQ(thrown([&] {
              gpuops::checkpoint([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom"); }, x);
            }),
            "std: boom");
  EXPECT_TRUE(at::equal(at::rand({4}), expected));
}

// ---------------------------------------------------------------- checkpoint_policy.h

TEST_F(HostileApi, ChooseForBudgetRefusesBadCostsNamingTheField) {
  using gpuops::choose_for_budget;
  EXPECT_TRUE(choose_for_budget({}, 0).empty());
  expect_value_error([] { choose_for_budget({}, -1); }, {"budget_bytes", "-1"});
  expect_value_error([] { choose_for_budget({{"a", 10, 0, 1.0}}, 0, 0); }, {"units", "0"});
  expect_value_error([] { choose_for_budget({{"a", -10, 0, 1.0}}, 0); }, {"'a'", "saved_bytes", "-10"});
  expect_value_error([] { choose_for_budget({{"a", 10, -1, 1.0}}, 0); }, {"'a'", "checkpointed_bytes", "-1"});
  for (double t : {kNan, kInf, -1.0})
    expect_value_error([&] { choose_for_budget({{"a", 10, 0, t}}, 0); }, {"'a'", "forward_seconds"});
  expect_value_error([] { choose_for_budget({{"a", 10, 4, 1.0}}, 3); }, {"budget_bytes 3", ">= 4"});
}

TEST_F(HostileApi, ChooseForBudgetWithHugeCostsOrUnitsNeitherOverflowsNorExhaustsMemory) {
  EXPECT_EXIT(report_and_exit([] {
                const int64_t big = INT64_MAX / 2 + 1;  // two of them overflow int64
                const auto chosen = gpuops::choose_for_budget({{"a", big, 0, 1.0}, {"b", big, 0, 2.0}}, big);
                if (chosen != std::vector<size_t>{0}) throw std::runtime_error("wrong choice");
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[(none|ValueError: choose_for_budget: .*overflow)");
  EXPECT_EXIT(report_and_exit([] { gpuops::choose_for_budget({{"a", 1 << 30, 0, 1.0}}, 0, INT64_MAX); }),
              ::testing::ExitedWithCode(0), "outcome=\\[ValueError: choose_for_budget: units");
  EXPECT_EXIT(report_and_exit([] {
                gpuops::choose_for_budget({{"a", int64_t{1} << 50, 0, 1.0}, {"b", int64_t{1} << 50, 0, 1.0}},
                                          int64_t{1} << 49, int64_t{1} << 40);
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[ValueError: choose_for_budget: units");
}

// ---------------------------------------------------------------- checkpointed_sequential.h

TEST_F(HostileApi, AnEmptyCheckpointedSequentialIsTheIdentity) {
  gpuops::CheckpointedSequential seq(torch::nn::Sequential{});
  auto x = at::randn({2, 3});
  EXPECT_TRUE(seq->checkpoint_every(1).empty());
  EXPECT_TRUE(seq->checkpoint_to_budget(0, x).empty());
  EXPECT_TRUE(seq->measure_layers(x).empty());
  EXPECT_TRUE(at::equal(seq->forward(x), x));
}

TEST_F(HostileApi, CheckpointedSequentialPoliciesRefuseBadArgumentsAndKeepTheirChoice) {
  gpuops::CheckpointedSequential seq(torch::nn::Sequential(torch::nn::Linear(4, 64), torch::nn::ReLU(),
                                                           torch::nn::Linear(64, 4)));
  seq->checkpoint_named({"1"});
  for (int64_t k : {int64_t{0}, int64_t{-3}}) expect_value_error([&] { seq->checkpoint_every(k); }, {"k must be >= 1"});
  expect_value_error([&] { seq->checkpoint_named({"0", "nope"}); }, {"'nope'", "accepted: 0, 1, 2"});
  expect_value_error([&] { seq->checkpoint_to_budget(-1, at::randn({2, 4})); }, {"budget_bytes", "-1"});
  expect_value_error([&] { seq->checkpoint_to_budget(1 << 20, at::Tensor()); }, {"sample"});
  expect_value_error([&] { seq->checkpoint_to_budget(0, at::randn({64, 4})); }, {"budget_bytes 0"});
  EXPECT_EQ(seq->checkpointed(), std::vector<std::string>{"1"});
}

TEST_F(HostileApi, LayersAddedAfterConstructionAreRunAndNamed) {
  EXPECT_EXIT(report_and_exit([] {
                torch::nn::Sequential layers(torch::nn::Linear(3, 3));
                gpuops::CheckpointedSequential seq(layers);
                layers->push_back(torch::nn::Linear(3, 3));
                layers->push_back(torch::nn::Linear(3, 3));
                seq->checkpoint_every(1);
                auto x = at::randn({2, 3});
                const auto expected = layers->forward(x);
                const auto got = seq->forward(x);
                if (!at::allclose(got, expected)) throw std::runtime_error("wrong output");
                if (seq->checkpointed().size() != 3) throw std::runtime_error("new layers not named");
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[none\\]");
}

// ---------------------------------------------------------------- flat_params.h

TEST_F(HostileApi, FlatParamsRefusesBadParamsAndOptionsChangingNothing) {
  using gpuops::FlatParams;
  auto p = leaf({4});
  const auto p_data = p.data_ptr();
  expect_value_error([] { FlatParams f({}); }, {"empty"});
  expect_value_error([&] { FlatParams f({p, p}); }, {"params[1]", "twice"});
  expect_value_error([&] { FlatParams f({p, at::Tensor()}); }, {"params[1]"});
  expect_value_error([&] { FlatParams f({p, at::randn({3})}); }, {"params[1]", "requires grad"});
  expect_value_error([&] { FlatParams f({p, (leaf({3}) * 2)}); }, {"params[1]", "leaf"});
  expect_value_error([&] { FlatParams f({p, leaf({4, 2}).t()}); }, {"params[1]"});
  for (int64_t a : {int64_t{0}, int64_t{3}, int64_t{8192}, int64_t{-16}, INT64_MAX})
    expect_value_error([&] { FlatParams f({p}, {a, 1}); }, {"alignment_bytes"});
  expect_value_error([&] { FlatParams f({p}, {2, 1}); }, {"alignment_bytes", "element size"});
  for (int64_t w : {int64_t{0}, int64_t{-1}, (int64_t{1} << 20) + 1, INT64_MAX})
    expect_value_error([&] { FlatParams f({p}, {16, w}); }, {"world_size"});
  EXPECT_EQ(p.data_ptr(), p_data);
}

TEST_F(HostileApi, FlatParamsShardIsChecked) {
  using gpuops::FlatParams;
  auto flat = at::arange(8, at::kFloat);
  expect_value_error([&] { FlatParams::shard(at::Tensor(), 0, 1); }, {"flat"});
  expect_value_error([&] { FlatParams::shard(at::zeros({2, 4}), 0, 2); }, {"flat"});
  expect_value_error([&] { FlatParams::shard(flat, 0, 3); }, {"world_size"});
  expect_value_error([&] { FlatParams::shard(flat, 0, 0); }, {"world_size"});
  expect_value_error([&] { FlatParams::shard(flat, 2, 2); }, {"rank", "2"});
  expect_value_error([&] { FlatParams::shard(flat, -1, 2); }, {"rank", "-1"});
  EXPECT_TRUE(at::equal(FlatParams::shard(flat, 1, 2), at::arange(4, 8, at::kFloat)));
}

TEST_F(HostileApi, FlatParamsOfZeroSizeAndScalarParameters) {
  auto a = leaf({}), b = leaf({0}), c = leaf({2, 3});
  const auto a0 = a.detach().clone(), c0 = c.detach().clone();
  gpuops::FlatParams flat({a, b, c});
  EXPECT_TRUE(flat.intact());
  EXPECT_TRUE(at::equal(a, a0));
  EXPECT_TRUE(at::equal(c, c0));
  (a * 2 + c.sum()).backward();
  EXPECT_TRUE(flat.intact());
  EXPECT_EQ(a.grad().item<float>(), 2.0f);
}

// ---------------------------------------------------------------- batch_search.h

gpuops::TrialRunner fits_below(int64_t limit) {
  return [limit](int64_t b) { return gpuops::TrialOutcome{b <= limit, b * 100, 0.0, {}}; };
}

TEST_F(HostileApi, BatchSearchOptionsOutOfRangeAreRefusedBeforeAnyTrial) {
  struct Bad {
    const char* name;
    std::function<void(gpuops::BatchSearchOptions&)> set;
  };
  const Bad bad[] = {
      {"low", [](auto& o) { o.low = 0; }},
      {"high", [](auto& o) { o.low = 8; o.high = 4; }},
      {"multiple_of", [](auto& o) { o.multiple_of = 0; }},
      {"margin", [](auto& o) { o.margin = 1.0; }},
      {"margin", [](auto& o) { o.margin = kNan; }},
      {"steps_per_trial", [](auto& o) { o.steps_per_trial = 0; }},
      {"max_trials", [](auto& o) { o.max_trials = -1; }},
      {"max_seconds", [](auto& o) { o.max_seconds = kNan; }},
      {"max_seconds", [](auto& o) { o.max_seconds = -1; }},
      {"seed", [](auto& o) { o.seed = 0; }},
      {"headroom_bytes", [](auto& o) { o.headroom_bytes = -5; }},
      {"cache_key", [](auto& o) { o.cache_file = "/tmp/x.json"; }},
      {"multiple of 8", [](auto& o) { o.low = 3; o.high = 7; o.multiple_of = 8; }},
  };
  for (const auto& b : bad) {
    gpuops::BatchSearchOptions o;
    b.set(o);
    int trials = 0;
    expect_value_error([&] {
      gpuops::search_max_batch([&](int64_t x) { ++trials; return gpuops::TrialOutcome{x <= 5, x, 0.0, {}}; }, o);
    }, {b.name});
    EXPECT_EQ(trials, 0) << b.name;
  }
  expect_value_error([] { gpuops::search_max_batch(gpuops::TrialRunner(), {}); }, {"run"});
  expect_value_error([] { gpuops::find_max_batch_size(gpuops::TrainingStep()); }, {"step"});
}

TEST_F(HostileApi, ARunnerThatThrowsSomethingElseIsPassedThrough) {
  EXPECT_EQ(thrown([] {
              gpuops::search_max_batch([](int64_t) -> gpuops::TrialOutcome { throw std::logic_error("bug in step"); },
                                       {});
            }),
            "std: bug in step");
}

TEST_F(HostileApi, ARunnerWithInconsistentPeaksStillEndsWithABatchThatRan) {
  // Peaks that shrink with the batch, are negative, or come with traces of different lengths; a batch that
  // runs although a smaller one did not. The search must end, and its answer must be a batch that ran.
  std::vector<gpuops::TrialRunner> runners = {
      [](int64_t b) { return gpuops::TrialOutcome{b <= 37, 1'000'000 / b, 0.0, {}}; },
      [](int64_t b) { return gpuops::TrialOutcome{b <= 37, b * 10, 0.0, std::vector<int64_t>(b % 5 + 1, b)}; },
      [](int64_t b) { return gpuops::TrialOutcome{b <= 37, b * 10, kNan, std::vector<int64_t>{-b, INT64_MAX}}; },
      [](int64_t b) { return gpuops::TrialOutcome{b <= 37 && b != 16, b * 10, 0.0, {}}; },
  };
  for (size_t i = 0; i < runners.size(); ++i) {
    std::set<int64_t> ran;
    gpuops::BatchSearchOptions o;
    o.high = 1000;
    const auto r = gpuops::search_max_batch([&](int64_t b) {
      auto out = runners[i](b);
      if (out.ok) ran.insert(b);
      return out;
    }, o);
    EXPECT_TRUE(ran.count(r.max_batch)) << "runner " << i << " answered " << r.max_batch;
    EXPECT_LE(r.trials.size(), 40u) << "runner " << i;
  }
}

TEST_F(HostileApi, ARunnerReportingANegativePeakIsNamed) {
  expect_value_error([] {
    gpuops::search_max_batch([](int64_t b) { return gpuops::TrialOutcome{b <= 37, -b, 0.0, {}}; }, {});
  }, {"peak_bytes -1", ">= 0"});
}

TEST_F(HostileApi, MemoryProfileRefusesBadPointsAndSaturatesItsPredictions) {
  using gpuops::fit_memory_profile;
  expect_value_error([] { fit_memory_profile({}); }, {"two points"});
  expect_value_error([] { fit_memory_profile({{4, 10}, {4, 20}}); }, {"distinct"});
  expect_value_error([] { fit_memory_profile({{0, 10}, {4, 20}}); }, {"batch"});
  expect_value_error([] { fit_memory_profile({{1, -10}, {4, 20}}); }, {"peak"});
  expect_value_error([] { fit_memory_profile({{1, 10}, {4, 20}}, kNan); }, {"tolerance"});
  const auto p = fit_memory_profile({{1, 1'000'000}, {2, 2'000'000}});
  EXPECT_EQ(p.predict(INT64_MAX), INT64_MAX);
  EXPECT_EQ(p.predict(int64_t{1} << 50), INT64_MAX);
  EXPECT_EQ(p.predict(0), 0);
  EXPECT_EQ(p.max_batch_for(-5), 0);
  const auto tiny = fit_memory_profile({{1, 0}, {int64_t{1} << 62, 1}});
  EXPECT_EQ(tiny.max_batch_for(INT64_MAX), INT64_MAX);
  gpuops::MemoryProfile garbage;
  garbage.fixed_bytes = kNan;
  garbage.per_sample_bytes = 1;
  EXPECT_EQ(garbage.max_batch_for(100), 0);
  EXPECT_EQ(garbage.predict(1), INT64_MAX);
}

TEST_F(HostileApi, ProfileMemoryRefusesBadBatchLists) {
  auto step = [](int64_t b) { at::empty({b * 100}); };
  expect_value_error([&] { gpuops::profile_memory(step, {}); }, {"two points"});
  expect_value_error([&] { gpuops::profile_memory(step, {2, 2}); }, {"distinct"});
  expect_value_error([&] { gpuops::profile_memory(step, {1, 0}); }, {"batch_sizes", "0"});
  expect_value_error([&] { gpuops::profile_memory(step, {1, 2}, c10::Device(c10::kCPU), 0); }, {"steps_per_trial"});
  expect_value_error([&] { gpuops::profile_memory(step, {1, 2}, c10::Device(c10::kMeta)); }, {"device", "meta"});
}

// ---------------------------------------------------------------- training_state.h (src/state: reported)

std::string state_folder(const char* name) {
  return "/tmp/gpuops-hostile-api-" + std::to_string(::getpid()) + "-" + name;
}

TEST_F(HostileApi, TrainingStateRefusesBadKeepAndSignalsLeavingNoHandler) {
  for (int64_t keep : {int64_t{0}, int64_t{-1}, INT64_MIN}) {
    gpuops::TrainingStateOptions o;
    o.keep = keep;
    expect_value_error([&] { gpuops::TrainingState s(state_folder("keep"), o); }, {"keep", std::to_string(keep).c_str()});
  }
  for (int sig : {0, SIGKILL, SIGSTOP, 999, -1}) {
    EXPECT_EXIT(report_and_exit([sig] {
                  gpuops::TrainingStateOptions o;
                  o.signals = {SIGTERM, SIGUSR1, sig};
                  std::string got = thrown([&] { gpuops::TrainingState s(state_folder("sig"), o); });
                  struct sigaction now {};
                  ::sigaction(SIGTERM, nullptr, &now);
                  if (now.sa_handler != SIG_DFL) got += " (a SIGTERM handler stayed installed)";
                  throw std::runtime_error(got);
                }),
                ::testing::ExitedWithCode(0),
                "outcome=\\[std: ValueError: TrainingState: signals has " + std::to_string(sig) +
                    ", which is not a signal that can be caught\\]");
  }
}

// Disabled: src/state defect reported to its owner (the second of two live TrainingStates stops catching SIGTERM
// once the first ends: each restores the handler it found). Enable with the fix.
TEST_F(HostileApi, TrainingStateSignalsListedTwiceOrByTwoObjectsStillEndAtTheDefault) {
  EXPECT_EXIT(report_and_exit([] {
                {
                  gpuops::TrainingStateOptions o;
                  o.signals = {SIGTERM, SIGTERM};
                  gpuops::TrainingState a(state_folder("twice"), o);
                  ::raise(SIGTERM);
                  if (!a.should_stop()) throw std::runtime_error("SIGTERM not caught");
                }
                struct sigaction now {};
                ::sigaction(SIGTERM, nullptr, &now);
                if (now.sa_handler != SIG_DFL) throw std::runtime_error("handler left after destruction");
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[none\\]");
  EXPECT_EXIT(report_and_exit([] {
                auto a = std::make_unique<gpuops::TrainingState>(state_folder("a"));
                auto b = std::make_unique<gpuops::TrainingState>(state_folder("b"));
                a.reset();  // b still lives: SIGTERM must still reach it
                ::raise(SIGTERM);
                if (!b->should_stop()) throw std::runtime_error("SIGTERM not caught by the live state");
              }),
              ::testing::ExitedWithCode(0), "outcome=\\[none\\]");
}

TEST_F(HostileApi, TrainingStateRefusesAFolderThatIsAFileOrEmpty) {
  const std::string file = state_folder("file");
  { std::ofstream(file) << "x"; }
  expect_value_error([&] { gpuops::TrainingState s(file); }, {file.c_str()});
  expect_value_error([&] { gpuops::TrainingState s(""); }, {"''", "folder"});
  ::unlink(file.c_str());
}

}  // namespace
