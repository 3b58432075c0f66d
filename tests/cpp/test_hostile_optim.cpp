// Hostile input to the C++ optimizers, GradScaler and GradAccumulator: the shared case table (the Python test
// runs the same one against the Python classes), duplicate parameters, and archives that do not fit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "gpuops/grad_accumulator.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/optimizers.h"

namespace {

using gpuops::amp::GradScaler;
using gpuops::amp::GradScalerOptions;
using torch::optim::OptimizerParamGroup;

struct Case {
  const char* target;
  const char* option;
  const char* value;
  const char* expected;  // a fragment of the ValueError, "" when the value is accepted
};

const Case kCases[] = {
#define CASE(target, option, value, expected) {target, option, value, expected},
#include "../hostile_cases/option_cases.inc"
#undef CASE
};

at::Tensor leaf() { return at::randn({3}).requires_grad_(true); }

// The scaler the GradScalerState cases load into, after one step.
GradScalerOptions state_scaler_options() {
  GradScalerOptions o;
  o.init_scale = 8.0;
  o.growth_interval = 3;
  o.max_scale = 4096.0;
  return o;
}

// Applies one case; throws what the library throws. Checks that a refused call changed nothing.
void apply(const Case& c) {
  const std::string target = c.target, option = c.option;
  const double v = std::strtod(c.value, nullptr);
  auto w = leaf();
  if (target == "AdamW") {
    gpuops::optim::AdamWOptions o;
    if (option == "lr") o.lr(v);
    if (option == "beta1") o.betas({v, 0.999});
    if (option == "beta2") o.betas({0.9, v});
    if (option == "eps") o.eps(v);
    if (option == "weight_decay") o.weight_decay(v);
    gpuops::optim::AdamW optimizer({w}, o);
    w.mutable_grad() = at::randn({3});
    optimizer.step();
    EXPECT_TRUE(at::isfinite(w).all().item<bool>());
  } else if (target == "SGD") {
    gpuops::optim::SGDOptions o(0.1);
    if (option == "lr") o.lr(v);
    if (option == "momentum") o.momentum(v);
    if (option == "dampening") o.momentum(0.9).dampening(v);
    if (option == "weight_decay") o.weight_decay(v);
    gpuops::optim::SGD optimizer({w}, o);
    w.mutable_grad() = at::randn({3});
    optimizer.step();
    EXPECT_TRUE(at::isfinite(w).all().item<bool>());
  } else if (target == "GradScaler") {
    GradScalerOptions o;
    if (option == "init_scale") o.init_scale = v;
    if (option == "growth_factor") o.growth_factor = v;
    if (option == "backoff_factor") o.backoff_factor = v;
    if (option == "min_scale") o.min_scale = v;
    if (option == "max_scale") o.max_scale = v;
    if (option == "growth_interval") o.growth_interval = std::strtoll(c.value, nullptr, 10);
    if (option == "hysteresis") o.hysteresis = std::strtoll(c.value, nullptr, 10);
    GradScaler scaler(o);
    EXPECT_TRUE(at::isfinite(scaler.scale(at::ones({}))).item<bool>());
  } else if (target == "GradScalerState") {
    GradScaler scaler(state_scaler_options());
    gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
    scaler.scale(w.sum()).backward();
    scaler.step(optimizer);
    scaler.update();
    const auto before = scaler.state_dict();
    auto state = before;
    state[option] = v;
    try {
      scaler.load_state_dict(state);
    } catch (const c10::ValueError&) {
      EXPECT_EQ(scaler.state_dict(), before) << "a refused load changed the scaler";
      throw;
    }
    EXPECT_EQ(scaler.state_dict().at(option), v);
    EXPECT_TRUE(at::isfinite(scaler.scale(at::ones({}))).item<bool>());  // still usable
  } else if (target == "GradDivisor") {
    GradScaler scaler;
    gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
    scaler.scale(w.sum()).backward();
    scaler.set_grad_divisor(optimizer, at::scalar_tensor(v, at::kDouble));
    const auto before = w.detach().clone();
    scaler.step(optimizer);
    EXPECT_TRUE(at::allclose(w, before - 0.1 / v));
  } else if (target == "GradAccumulator") {
    gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
    gpuops::GradAccumulatorOptions o;
    o.window = option == "window" ? std::strtoll(c.value, nullptr, 10) : 2;
    if (option == "max_norm") o.max_norm = v;
    gpuops::GradAccumulator accumulator(optimizer, o);
  } else if (target == "AccumulatorCount") {
    gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
    gpuops::GradAccumulator accumulator(optimizer, {2});
    try {
      accumulator.backward(w.sum(), v);
    } catch (const c10::ValueError&) {
      EXPECT_EQ(accumulator.micro_batches(), 0);
      EXPECT_FALSE(w.grad().defined());  // refused before backward
      throw;
    }
    EXPECT_EQ(accumulator.micro_batches(), 1);
  } else {
    FAIL() << "unknown target " << target;
  }
}

TEST(HostileOptim, TheSharedCaseTableGetsTheSameAnswersInCpp) {
  ASSERT_GT(std::size(kCases), 60u);
  for (const Case& c : kCases) {
    std::string error;
    try {
      apply(c);
    } catch (const c10::ValueError& e) {
      error = e.what_without_backtrace();
    }
    const std::string expected = c.expected;
    if (expected.empty()) {
      EXPECT_EQ(error, "") << c.target << " " << c.option << "=" << c.value << " should be accepted";
    } else {
      EXPECT_NE(error.find(expected), std::string::npos)
          << c.target << " " << c.option << "=" << c.value << ": expected '" << expected << "', got '" << error << "'";
    }
  }
}

TEST(HostileOptim, ADuplicateParameterIsRefusedInOneGroupAndAcrossGroups) {
  auto p = leaf(), q = leaf();
  EXPECT_THROW(gpuops::optim::AdamW({p, p}), c10::ValueError);
  const std::vector<OptimizerParamGroup> groups{OptimizerParamGroup({p}), OptimizerParamGroup({q, p})};
  try {
    gpuops::optim::SGD sgd(groups, gpuops::optim::SGDOptions(0.1));
    ADD_FAILURE() << "no error for a parameter in two groups";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("listed twice (in param_groups[0] and param_groups[1])"), std::string::npos)
        << e.what();
  }
  // add_param_group (not virtual, no check of its own before the first step) is caught at the step.
  gpuops::optim::AdamW optimizer({p});
  optimizer.add_param_group(OptimizerParamGroup({p}));
  p.mutable_grad() = at::randn({3});
  const auto before = p.detach().clone();
  EXPECT_THROW(optimizer.step(), c10::ValueError);
  EXPECT_TRUE(at::equal(p, before));
}

template <typename Optimizer>
std::string saved(Optimizer& optimizer) {
  std::ostringstream out;
  torch::save(optimizer, out);
  return out.str();
}

template <typename Optimizer>
void load(Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(optimizer, in);
}

TEST(HostileOptim, ALoadThatDoesNotFitChangesNothing) {
  // Same parameter count, other shapes: refused before the lr or any state changes.
  auto a = at::randn({2, 3}).requires_grad_(true);
  gpuops::optim::AdamW source({a}, gpuops::optim::AdamWOptions(0.5));
  a.mutable_grad() = at::randn({2, 3});
  source.step();
  auto b = at::randn({6}).requires_grad_(true);
  gpuops::optim::AdamW target({b}, gpuops::optim::AdamWOptions(0.01));
  b.mutable_grad() = at::randn({6});
  target.step();
  const auto exp_avg = static_cast<gpuops::optim::AdamWParamState&>(*target.state().begin()->second).exp_avg().clone();
  try {
    load(target, saved(source));
    ADD_FAILURE() << "a wrong-shaped state was loaded";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("has shape [2, 3] but its parameter has shape [6]"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(target.param_groups()[0].options().get_lr(), 0.01);
  EXPECT_TRUE(at::equal(
      static_cast<gpuops::optim::AdamWParamState&>(*target.state().begin()->second).exp_avg(), exp_avg));

  // Another optimizer's archive, and a file that is no optimizer archive: clear errors, nothing changed.
  auto c = leaf();
  gpuops::optim::SGD sgd({c}, gpuops::optim::SGDOptions(0.3).momentum(0.9));
  auto d = at::randn({6}).requires_grad_(true);
  gpuops::optim::AdamW adamw({d}, gpuops::optim::AdamWOptions(0.01));
  try {
    load(adamw, saved(sgd));
    ADD_FAILURE() << "an SGD archive loaded into AdamW";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("the archive holds the state of SGD, not of AdamW"), std::string::npos)
        << e.what();
  }
  // Adam and AdamW share torch's archive layout; the weight decay means another thing in each.
  auto e = leaf();
  gpuops::optim::Adam adam({e}, gpuops::optim::AdamOptions(0.01).weight_decay(0.1));
  try {
    load(adamw, saved(adam));
    ADD_FAILURE() << "an Adam archive loaded into AdamW";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("holds the state of Adam, not of AdamW"), std::string::npos)
        << error.what();
  }
  std::ostringstream tensor_file;
  torch::save(at::ones({3}), tensor_file);
  EXPECT_THROW(load(adamw, tensor_file.str()), c10::ValueError);
  EXPECT_EQ(adamw.param_groups()[0].options().get_lr(), 0.01);
  EXPECT_TRUE(adamw.state().empty());
}

// A torch::optim archive loads into ours and the next steps continue it as torch's own optimizer would.
template <typename Ours, typename Theirs>
void expect_continues_torch(Theirs& theirs, at::Tensor& theirs_param, Ours& ours, at::Tensor& ours_param) {
  for (int step = 0; step < 3; ++step) {
    theirs_param.mutable_grad() = at::randn({5});
    theirs.step();
  }
  {
    torch::NoGradGuard no_grad;
    ours_param.copy_(theirs_param);
  }
  load(ours, saved(theirs));
  for (int step = 0; step < 2; ++step) {
    const auto grad = at::randn({5});
    theirs_param.mutable_grad() = grad.clone();
    ours_param.mutable_grad() = grad.clone();
    theirs.step();
    ours.step();
  }
  EXPECT_TRUE(at::allclose(ours_param, theirs_param, 1e-5, 1e-6)) << ours_param << theirs_param;
}

TEST(HostileOptim, TorchOptimArchivesLoadIntoOurs) {
  auto t = at::randn({5}).requires_grad_(true), o = at::randn({5}).requires_grad_(true);
  torch::optim::AdamW theirs({t}, torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  gpuops::optim::AdamW ours({o}, gpuops::optim::AdamWOptions(0.9));
  expect_continues_torch(theirs, t, ours, o);
  EXPECT_EQ(ours.param_groups()[0].options().get_lr(), 0.05);

  auto ts = at::randn({5}).requires_grad_(true), os = at::randn({5}).requires_grad_(true);
  torch::optim::SGD theirs_sgd({ts}, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.1));
  gpuops::optim::SGD ours_sgd({os}, gpuops::optim::SGDOptions(0.7));
  expect_continues_torch(theirs_sgd, ts, ours_sgd, os);
}

TEST(HostileOptim, TheCppScalerRefusesAScaleAboveMaxScaleAndStaysUsable) {
  GradScaler scaler(state_scaler_options());
  auto w = leaf();
  gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
  scaler.scale(w.sum()).backward();
  scaler.step(optimizer);
  scaler.update();
  auto state = scaler.state_dict();
  const auto before = state;
  state["max_scale"] = 16.0;
  state["scale"] = 32.0;  // above max_scale
  EXPECT_THROW(scaler.load_state_dict(state), c10::ValueError);
  EXPECT_EQ(scaler.state_dict(), before);
  EXPECT_EQ(scaler.scale(at::ones({})).item<float>(), 8.0f);
}

}  // namespace
