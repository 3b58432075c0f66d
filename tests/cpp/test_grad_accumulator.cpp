// gpuops::GradAccumulator: a window of micro-batches with unequal token counts equals one big batch (the
// mean over every token), for gpuops' fused SGD and torch::optim::SGD; a short last window; overflow skip.
#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/sgd.h>

#include "gpuops/grad_accumulator.h"
#include "gpuops/optimizers.h"

namespace {

struct Batch {
  at::Tensor x, y, mask;
};

std::vector<Batch> micro_batches(const std::vector<int64_t>& sizes) {
  std::vector<Batch> out;
  for (int64_t n : sizes) {
    Batch b{at::randn({n, 6}), at::randn({n, 3}), at::rand({n, 3}) < 0.7};
    b.mask.index_put_({0, 0}, true);
    out.push_back(b);
  }
  return out;
}

// Sum of the masked per-token squared errors, and the token count.
std::pair<at::Tensor, at::Tensor> token_loss_sum(const at::Tensor& w, const Batch& b) {
  return {((b.x.matmul(w) - b.y).square() * b.mask).sum(), b.mask.sum()};
}

template <typename MakeOptimizer>
void expect_window_equals_big_batch(MakeOptimizer make) {
  const auto batches = micro_batches({3, 7, 1, 5});
  const at::Tensor init = at::randn({6, 3});
  auto ours = init.clone().requires_grad_(true), ref = init.clone().requires_grad_(true);
  auto ours_opt = make(ours), ref_opt = make(ref);
  gpuops::GradAccumulatorOptions options;
  options.window = 4;
  gpuops::GradAccumulator accumulator(*ours_opt, options);
  std::vector<bool> stepped;
  for (const auto& b : batches) {
    auto [loss, count] = token_loss_sum(ours, b);
    stepped.push_back(accumulator.backward(loss, count));
  }
  EXPECT_EQ(stepped, (std::vector<bool>{false, false, false, true}));
  at::Tensor loss = at::zeros({}), count = at::zeros({});
  for (const auto& b : batches) {
    auto [l, c] = token_loss_sum(ref, b);
    loss = loss + l;
    count = count + c;
  }
  (loss / count).backward();
  ref_opt->step();
  EXPECT_TRUE(at::allclose(ours, ref, 1e-6, 1e-6));
}

TEST(GradAccumulator, AWindowEqualsOneBigBatchWithFusedAndTorchOptimizers) {
  expect_window_equals_big_batch([](at::Tensor w) {
    return std::make_unique<gpuops::optim::SGD>(std::vector<at::Tensor>{w}, gpuops::optim::SGDOptions(0.5));
  });
  expect_window_equals_big_batch([](at::Tensor w) {
    return std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5));
  });
}

TEST(GradAccumulator, ShortLastWindowAndOverflowSkip) {
  auto w = at::randn({6, 3}).requires_grad_(true);
  gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.5));
  gpuops::amp::GradScaler scaler;
  gpuops::GradAccumulatorOptions options;
  options.window = 3;
  int boundaries = 0;
  options.on_boundary = [&] { ++boundaries; };
  gpuops::GradAccumulator accumulator(optimizer, options, &scaler);
  const auto batches = micro_batches({2, 4, 3, 5});
  const auto before = w.detach().clone();
  for (size_t i = 0; i < 3; ++i) {
    auto [loss, count] = token_loss_sum(w, batches[i]);
    accumulator.backward(i == 1 ? loss * INFINITY : loss, count);  // an overflow mid-window
  }
  EXPECT_TRUE(at::equal(w, before));
  EXPECT_EQ(scaler.skipped_steps(), 1);
  auto [loss, count] = token_loss_sum(w, batches[3]);
  EXPECT_FALSE(accumulator.backward(loss, count));
  EXPECT_TRUE(accumulator.flush());  // a short window of one micro-batch: its own mean
  EXPECT_FALSE(accumulator.flush());
  EXPECT_EQ(boundaries, 2);
  auto ref = before.clone().requires_grad_(true);
  auto [l, c] = token_loss_sum(ref, batches[3]);
  (l / c).backward();
  EXPECT_TRUE(at::allclose(w, before - 0.5 * ref.grad(), 1e-6, 1e-6));
}

TEST(GradAccumulator, BadOptionsAreValueErrors) {
  auto w = at::randn({2}).requires_grad_(true);
  gpuops::optim::SGD optimizer({w}, gpuops::optim::SGDOptions(0.1));
  gpuops::GradAccumulatorOptions options;
  options.window = 0;
  EXPECT_THROW(gpuops::GradAccumulator(optimizer, options), c10::ValueError);
  options.window = 2;
  options.max_norm = -1.0;
  EXPECT_THROW(gpuops::GradAccumulator(optimizer, options), c10::ValueError);
}

}  // namespace
