// gpuops::amp::GradScaler against torch's scale rule (at::_amp_update_scale_), with gpuops' fused
// optimizers (device-side skip) and torch::optim ones (host read), clipping against
// torch::nn::utils::clip_grad_norm_, checkpoints and misuse.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include "gpuops/grad_scaler.h"
#include "gpuops/optimizers.h"

namespace {

using gpuops::amp::GradScaler;
using gpuops::amp::GradScalerOptions;

// Runs 12 steps with overflows injected at `overflow_steps`; checks the scale against torch's rule after
// every update, and that an overflow step leaves the parameter bit-identical.
template <typename Optimizer>
void expect_torch_scale_rule(Optimizer& optimizer, at::Tensor& w) {
  GradScalerOptions o;
  o.init_scale = 1024;
  o.growth_interval = 3;
  GradScaler scaler(o);
  auto ref_scale = at::full({1}, 1024.0f), ref_tracker = at::zeros({1}, at::kInt);
  const std::set<int> overflow_steps = {2, 5, 6};
  for (int step = 0; step < 12; ++step) {
    const auto x = at::randn({8});
    auto loss = (w * x).sum();
    scaler.scale(loss).backward();
    const bool overflow = overflow_steps.count(step) > 0;
    if (overflow) w.mutable_grad()[step % 8] = step % 2 ? INFINITY : NAN;
    const auto before = w.detach().clone();
    scaler.step(optimizer);
    EXPECT_EQ(scaler.step_applied().item<bool>(), !overflow) << step;
    if (overflow) EXPECT_TRUE(at::equal(w, before)) << "step " << step << " changed the parameter";
    else EXPECT_FALSE(at::equal(w, before)) << step;
    scaler.update();
    at::_amp_update_scale_(ref_scale, ref_tracker, at::full({1}, overflow ? 1.0f : 0.0f), 2.0, 0.5, 3);
    EXPECT_EQ(scaler.get_scale(), ref_scale.item<float>()) << "after step " << step;
    optimizer.zero_grad();
  }
  EXPECT_EQ(scaler.skipped_steps(), 3);
  EXPECT_EQ(scaler.state_dict().at("_growth_tracker"), ref_tracker.item<int>());
}

TEST(GradScaler, FollowsTorchsScaleRuleWithFusedOptimizers) {
  auto w = at::randn({8}).requires_grad_(true);
  gpuops::optim::AdamW optimizer({w}, gpuops::optim::AdamWOptions(1e-2));
  expect_torch_scale_rule(optimizer, w);
}

TEST(GradScaler, FollowsTorchsScaleRuleWithTorchOptimizers) {
  auto w = at::randn({8}).requires_grad_(true);
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(1e-2).momentum(0.9));
  expect_torch_scale_rule(optimizer, w);
}

TEST(GradScaler, ScaledStepEqualsAnUnscaledStep) {
  // A power-of-two scale divides exactly: the fused step on scaled gradients is bit-identical to a plain
  // step on the unscaled ones.
  const auto init = at::randn({1000});
  const auto x = at::randn({1000});
  auto a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
  gpuops::optim::AdamW oa({a}), ob({b});
  GradScaler scaler;
  scaler.scale((a * x).square().sum()).backward();
  scaler.step(oa);
  scaler.update();
  (b * x).square().sum().backward();
  ob.step();
  EXPECT_TRUE(at::equal(a, b));
}

TEST(GradScaler, ClipGradNormMatchesTorchAndFoldsIntoTheStep) {
  for (bool fused : {true, false}) {
    const auto init = at::randn({300});
    const auto x = at::randn({300}) * 10;
    auto a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
    std::unique_ptr<torch::optim::Optimizer> oa, ob;
    if (fused) {
      oa = std::make_unique<gpuops::optim::SGD>(std::vector<at::Tensor>{a}, gpuops::optim::SGDOptions(0.1));
    } else {
      oa = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{a}, torch::optim::SGDOptions(0.1));
    }
    ob = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{b}, torch::optim::SGDOptions(0.1));
    GradScaler scaler;
    scaler.scale((a * x).square().sum()).backward();
    const double norm = scaler.clip_grad_norm_(*oa, 1.0).item<double>();
    scaler.step(*oa);
    scaler.update();
    (b * x).square().sum().backward();
    const double torch_norm = torch::nn::utils::clip_grad_norm_(std::vector<at::Tensor>{b}, 1.0);
    ob->step();
    EXPECT_NEAR(norm, torch_norm, 1e-5 * torch_norm) << "fused " << fused;
    EXPECT_TRUE(at::allclose(a, b, 1e-6, 1e-7)) << "fused " << fused;
  }
}

TEST(GradScaler, MisuseSaysWhatToDo) {
  auto w = at::randn({4}).requires_grad_(true);
  gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
  GradScaler scaler;
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { scaler.step(optimizer); }).find("before any scale()"), std::string::npos);
  auto loss = scaler.scale(w.sum());
  EXPECT_NE(message([&] { scaler.step(optimizer); }).find("no gradients"), std::string::npos);
  loss.backward();
  scaler.unscale_(optimizer);
  EXPECT_NE(message([&] { scaler.unscale_(optimizer); }).find("once per step"), std::string::npos);
  scaler.step(optimizer);
  EXPECT_NE(message([&] { scaler.step(optimizer); }).find("update()"), std::string::npos);
  scaler.update();
  EXPECT_NE(message([&] { scaler.update(); }).find("no unscale_() or step()"), std::string::npos);
  GradScalerOptions bad;
  bad.backoff_factor = 1.5;
  EXPECT_NE(message([&] { GradScaler s(bad); }).find("backoff_factor"), std::string::npos);
}

TEST(GradScaler, StateDictRoundTripsAndABadOneChangesNothing) {
  GradScalerOptions o;
  o.hysteresis = 2;
  GradScaler a(o);
  auto w = at::randn({4}).requires_grad_(true);
  gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
  for (int i = 0; i < 3; ++i) {
    a.scale(w.sum()).backward();
    w.mutable_grad()[0] = INFINITY;
    a.step(optimizer);
    a.update();
    optimizer.zero_grad();
  }
  const auto state = a.state_dict();
  EXPECT_EQ(state.at("_skipped_steps"), 3);
  GradScaler b(o);
  b.load_state_dict(state);
  EXPECT_EQ(b.state_dict(), state);
  auto broken = state;
  broken["backoff_factor"] = 2.0;
  EXPECT_THROW(b.load_state_dict(broken), c10::ValueError);
  broken = state;
  broken.erase("scale");
  EXPECT_THROW(b.load_state_dict(broken), c10::ValueError);
  EXPECT_EQ(b.state_dict(), state);
}

TEST(GradScaler, DisabledIsAPassThrough) {
  GradScalerOptions o;
  o.enabled = false;
  GradScaler scaler(o);
  auto w = at::randn({4}).requires_grad_(true);
  gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
  const auto loss = w.sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  const auto before = w.detach().clone();
  scaler.step(optimizer);
  scaler.update();
  EXPECT_TRUE(at::allclose(w, before - 0.1));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

}  // namespace
