// CheckpointedSequential's policies and the budget knapsack (checked against brute force).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "gpuops/checkpointed_sequential.h"
#include "gpuops/memory_budget.h"

namespace {

constexpr int kLayers = 8;

// A feed-forward block; blocks of different widths differ in activation bytes and time.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t inner)
      : up(register_module("up", torch::nn::Linear(32, inner))),
        dropout(register_module("dropout", torch::nn::Dropout(0.1))),
        down(register_module("down", torch::nn::Linear(inner, 32))) {}
  at::Tensor forward(const at::Tensor& x) { return down(dropout(at::gelu(up(x)))); }
  torch::nn::Linear up;
  torch::nn::Dropout dropout;
  torch::nn::Linear down;
};
TORCH_MODULE(Block);

gpuops::CheckpointedSequential make_stack() {
  torch::manual_seed(0);
  torch::nn::Sequential layers;
  for (int i = 0; i < kLayers; ++i) layers->push_back(Block(64 * (1 + i % 3)));
  return gpuops::CheckpointedSequential(layers);
}

std::vector<at::Tensor> gradients(gpuops::CheckpointedSequential& model, const at::Tensor& data) {
  model->zero_grad();
  torch::manual_seed(3);
  model->forward(data).square().mean().backward();  // the data does not require grad
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

TEST(CheckpointedSequential, EveryKAndNamedGiveThePlainGradientsBitwise) {
  auto model = make_stack();
  const auto data = at::randn({256, 32});
  const auto plain = gradients(model, data);
  EXPECT_EQ(model->checkpoint_every(3), (std::vector<std::string>{"0", "3", "6"}));
  const auto every3 = gradients(model, data);
  EXPECT_EQ(model->checkpoint_named({"7", "0", "2"}), (std::vector<std::string>{"0", "2", "7"}));
  const auto named = gradients(model, data);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(plain[i], every3[i])) << i;  // including layer 0, whose input needs no grad
    EXPECT_TRUE(at::equal(plain[i], named[i])) << i;
  }
}

TEST(CheckpointedSequential, PoliciesRejectBadArgumentsAndKeepTheirChoice) {
  auto model = make_stack();
  model->checkpoint_every(2);
  EXPECT_THROW(model->checkpoint_every(0), c10::ValueError);
  try {
    model->checkpoint_named({"1", "nine"});
    ADD_FAILURE() << "unknown name accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'nine', which is not a layer; accepted: 0, 1, 2"), std::string::npos);
  }
  EXPECT_THROW(model->checkpoint_to_budget(0, at::randn({64, 32})), c10::ValueError);  // below the floor
  EXPECT_EQ(model->checkpointed(), (std::vector<std::string>{"0", "2", "4", "6"}));  // unchanged
}

// Bytes the forward leaves allocated for the backward (the activations), measured.
int64_t held_after_forward(gpuops::CheckpointedSequential& model, const at::Tensor& data) {
  gpuops::MemoryBudget counter;
  auto out = model->forward(data);
  return counter.current_bytes();
}

TEST(CheckpointedSequential, BudgetChoiceFitsAndRecomputesLessThanEverything) {
  auto model = make_stack();
  const auto data = at::randn({512, 32});
  const auto costs = model->measure_layers(data);
  ASSERT_EQ(costs.size(), static_cast<size_t>(kLayers));
  double all_seconds = 0;
  for (const auto& c : costs) {
    EXPECT_GT(c.saved_bytes, c.checkpointed_bytes);
    EXPECT_GT(c.forward_seconds, 0);
    all_seconds += c.forward_seconds;
  }
  const int64_t plain = held_after_forward(model, data);
  model->checkpoint_every(1);
  const int64_t everything = held_after_forward(model, data);
  const int64_t budget = everything + (plain - everything) / 2;

  const auto chosen = model->checkpoint_to_budget(budget, data);
  EXPECT_FALSE(chosen.empty());
  EXPECT_LT(chosen.size(), static_cast<size_t>(kLayers));
  EXPECT_LE(held_after_forward(model, data), budget) << "plain " << plain << ", all checkpointed " << everything;
  double chosen_seconds = 0;
  for (const auto& c : costs)
    if (std::count(chosen.begin(), chosen.end(), c.name)) chosen_seconds += c.forward_seconds;
  EXPECT_LT(chosen_seconds, all_seconds);
}

// Held bytes and recomputation time of checkpointing the layers in `chosen`.
std::pair<int64_t, double> cost_of(const std::vector<gpuops::LayerCost>& costs, const std::vector<size_t>& chosen) {
  int64_t held = 0;
  double time = 0;
  for (size_t i = 0; i < costs.size(); ++i) {
    const bool on = std::count(chosen.begin(), chosen.end(), i) > 0;
    held += on ? costs[i].checkpointed_bytes : costs[i].saved_bytes;
    time += on ? costs[i].forward_seconds : 0;
  }
  return {held, time};
}

// The least recomputation time that fits `budget`, by brute force over every subset.
double brute_force_best(const std::vector<gpuops::LayerCost>& costs, int64_t budget) {
  double best = std::numeric_limits<double>::infinity();
  for (uint32_t mask = 0; mask < (1u << costs.size()); ++mask) {
    std::vector<size_t> chosen;
    for (size_t i = 0; i < costs.size(); ++i)
      if (mask >> i & 1) chosen.push_back(i);
    const auto [held, time] = cost_of(costs, chosen);
    if (held <= budget) best = std::min(best, time);
  }
  return best;
}

TEST(ChooseForBudget, IsExactWithinItsStepAndNeverExceedsTheBudget) {
  std::mt19937 rng(42);
  std::uniform_int_distribution<int64_t> bytes(1, 500);
  std::uniform_real_distribution<double> seconds(0.1, 2.0);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 1 + rng() % 10;
    std::vector<gpuops::LayerCost> costs(n);
    int64_t total = 0, floor = 0;
    for (auto& c : costs) {
      c.checkpointed_bytes = bytes(rng) / 5;
      c.saved_bytes = c.checkpointed_bytes + bytes(rng);
      c.forward_seconds = seconds(rng);
      total += c.saved_bytes;
      floor += c.checkpointed_bytes;
    }
    const int64_t budget = floor + static_cast<int64_t>(rng() % static_cast<uint32_t>(total - floor + 1));
    // Savings total at most 5000 bytes: with units >= that, one byte per step, the exact optimum.
    const auto exact = cost_of(costs, gpuops::choose_for_budget(costs, budget, 5000));
    EXPECT_LE(exact.first, budget) << trial;
    EXPECT_NEAR(exact.second, brute_force_best(costs, budget), 1e-9) << trial;
    // Coarse steps (about 100 bytes): still within budget, and no worse than the optimum of a budget
    // tighter by one step per layer.
    const int64_t units = 50, step = (total - floor + units - 1) / units;
    const auto coarse = cost_of(costs, gpuops::choose_for_budget(costs, budget, units));
    EXPECT_LE(coarse.first, budget) << trial;
    const int64_t tighter = budget - static_cast<int64_t>(n) * step;
    if (tighter >= floor) EXPECT_LE(coarse.second, brute_force_best(costs, tighter) + 1e-9) << trial;
  }
}

// Held bytes and time of one choice per layer (keep, offload, recompute).
std::pair<int64_t, double> cost_of(const std::vector<gpuops::LayerCost>& costs,
                                   const std::vector<gpuops::LayerChoice>& choices) {
  int64_t held = 0;
  double time = 0;
  for (size_t i = 0; i < costs.size(); ++i) {
    const auto& c = costs[i];
    switch (choices[i]) {
      case gpuops::LayerChoice::Keep: held += c.saved_bytes; break;
      case gpuops::LayerChoice::Offload: held += c.offloaded_bytes, time += c.offload_seconds; break;
      case gpuops::LayerChoice::Recompute: held += c.checkpointed_bytes, time += c.forward_seconds; break;
    }
  }
  return {held, time};
}

// The least time that fits `budget`, by brute force over every choice of every layer (offload only where
// offload_seconds >= 0).
double brute_force_placements(const std::vector<gpuops::LayerCost>& costs, int64_t budget) {
  double best = std::numeric_limits<double>::infinity();
  uint32_t count = 1;
  for (size_t i = 0; i < costs.size(); ++i) count *= 3;
  for (uint32_t code = 0; code < count; ++code) {
    std::vector<gpuops::LayerChoice> choices;
    bool possible = true;
    for (uint32_t rest = code, i = 0; i < costs.size(); ++i, rest /= 3) {
      choices.push_back(static_cast<gpuops::LayerChoice>(rest % 3));
      possible = possible && (choices.back() != gpuops::LayerChoice::Offload || costs[i].offload_seconds >= 0);
    }
    const auto [held, time] = cost_of(costs, choices);
    if (possible && held <= budget) best = std::min(best, time);
  }
  return best;
}

TEST(ChoosePlacements, KeepOffloadOrRecomputeIsExactAndNeverExceedsTheBudget) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> bytes(1, 500);
  std::uniform_real_distribution<double> seconds(0.1, 2.0);
  int offloaded = 0, recomputed = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 1 + rng() % 7;
    std::vector<gpuops::LayerCost> costs(n);
    int64_t total = 0, floor = 0;
    for (auto& c : costs) {
      c.checkpointed_bytes = bytes(rng) / 5;
      c.offloaded_bytes = bytes(rng) / 5;
      c.saved_bytes = std::max(c.checkpointed_bytes, c.offloaded_bytes) + bytes(rng);
      c.forward_seconds = seconds(rng);
      c.offload_seconds = rng() % 4 == 0 ? -1.0 : seconds(rng);  // now and then not a choice
      total += c.saved_bytes;
      floor += c.offload_seconds >= 0 ? std::min(c.checkpointed_bytes, c.offloaded_bytes) : c.checkpointed_bytes;
    }
    const int64_t budget = floor + static_cast<int64_t>(rng() % static_cast<uint32_t>(total - floor + 1));
    const auto choices = gpuops::choose_placements(costs, budget, 5000);  // one byte per step: exact
    const auto [held, time] = cost_of(costs, choices);
    EXPECT_LE(held, budget) << trial;
    EXPECT_NEAR(time, brute_force_placements(costs, budget), 1e-9) << trial;
    for (size_t i = 0; i < n; ++i) {
      EXPECT_FALSE(choices[i] == gpuops::LayerChoice::Offload && costs[i].offload_seconds < 0) << trial;
      offloaded += choices[i] == gpuops::LayerChoice::Offload;
      recomputed += choices[i] == gpuops::LayerChoice::Recompute;
    }
  }
  EXPECT_GT(offloaded, 0);  // both kinds of choice were taken somewhere
  EXPECT_GT(recomputed, 0);
  // Below what the smallest choices hold: refused, naming the least budget.
  std::vector<gpuops::LayerCost> costs{{"a", 100, 40, 1.0, 10, 0.5}};
  EXPECT_EQ(gpuops::choose_placements(costs, 10), std::vector<gpuops::LayerChoice>{gpuops::LayerChoice::Offload});
  try {
    gpuops::choose_placements(costs, 9);
    FAIL() << "a budget below the floor was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpointing or offloading every layer still holds; accepted: >= 10"),
              std::string::npos) << e.what();
  }
  costs[0].offload_seconds = std::nan("");
  EXPECT_THROW(gpuops::choose_placements(costs, 50), c10::ValueError);
}

}  // namespace
