// gpuops::checkpoint: gradients bit-identical to a plain run (transformer layers with dropout), the step's
// peak under MemoryBudget, BatchNorm statistics updated once, several outputs, and the clear errors.
#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/nn/modules/container/modulelist.h>

#include "gpuops/checkpoint.h"
#include "gpuops/memory_budget.h"

namespace {

constexpr int kLayers = 12, kWidth = 64;

torch::nn::ModuleList make_stack() {
  torch::manual_seed(0);
  torch::nn::ModuleList layers;
  for (int i = 0; i < kLayers; ++i)
    layers->push_back(torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(kWidth, 4).dim_feedforward(4 * kWidth).dropout(0.1)));
  return layers;
}

at::Tensor run(torch::nn::ModuleList& layers, at::Tensor x, bool checkpointed) {
  for (const auto& module : *layers) {
    auto layer = module->as<torch::nn::TransformerEncoderLayer>();
    auto forward = [layer](const at::Tensor& h) { return layer->forward(h); };
    x = checkpointed ? gpuops::checkpoint(forward, x) : forward(x);
  }
  return x.square().mean();
}

// Gradients of the parameters and of the input after one backward with the dropout masks of `seed`.
std::vector<at::Tensor> gradients(torch::nn::ModuleList& layers, const at::Tensor& data, bool checkpointed) {
  for (auto& p : layers->parameters()) p.mutable_grad() = at::Tensor();
  auto x = data.clone().requires_grad_(true);
  torch::manual_seed(7);
  run(layers, x, checkpointed).backward();
  std::vector<at::Tensor> grads{x.grad()};
  for (const auto& p : layers->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

TEST(Checkpoint, GradientsEqualThePlainOnesBitwiseWithDropout) {
  auto layers = make_stack();
  const auto data = at::randn({16, 4, kWidth});  // (seq, batch, width)
  const auto plain = gradients(layers, data, false);
  const auto checkpointed = gradients(layers, data, true);
  ASSERT_EQ(plain.size(), checkpointed.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(at::equal(plain[i], checkpointed[i])) << i;
  // The comparison has teeth: without replaying the RNG, the recomputed dropout masks differ.
  for (auto& p : layers->parameters()) p.mutable_grad() = at::Tensor();
  auto x = data.clone().requires_grad_(true);
  torch::manual_seed(7);
  gpuops::CheckpointOptions no_replay;
  no_replay.preserve_rng_state = false;
  at::Tensor h = x;
  for (const auto& module : *layers) {
    auto layer = module->as<torch::nn::TransformerEncoderLayer>();
    h = gpuops::checkpoint([layer](const at::Tensor& t) { return layer->forward(t); }, h, no_replay);
  }
  h.square().mean().backward();
  EXPECT_FALSE(at::equal(x.grad(), plain[0]));
}

TEST(Checkpoint, FullCheckpointingCutsTheStepPeakBy60Percent) {
  auto layers = make_stack();
  const auto data = at::randn({64, 4, kWidth});
  for (auto& p : layers->parameters()) p.mutable_grad() = at::zeros_like(p);  // both runs count them alike
  auto peak = [&](bool checkpointed) {
    auto x = data.clone().requires_grad_(true);
    gpuops::MemoryBudget budget;
    run(layers, x, checkpointed).backward();
    return budget.peak_bytes();
  };
  const int64_t plain = peak(false), checkpointed = peak(true);
  EXPECT_LE(checkpointed * 10, plain * 4) << "plain " << plain << " checkpointed " << checkpointed;
}

TEST(Checkpoint, BatchNormStatisticsAreUpdatedOnce) {
  torch::nn::BatchNorm1d plain_bn(8), ckpt_bn(8);
  const auto data = at::randn({32, 8}) * 3 + 1;
  plain_bn->forward(data.clone().requires_grad_(true)).sum().backward();
  gpuops::CheckpointOptions options;
  options.buffers = ckpt_bn->buffers();
  auto x = data.clone().requires_grad_(true);
  gpuops::checkpoint([&](const at::Tensor& t) { return ckpt_bn->forward(t); }, x, options).sum().backward();
  EXPECT_TRUE(at::allclose(ckpt_bn->running_mean, plain_bn->running_mean));
  EXPECT_TRUE(at::allclose(ckpt_bn->running_var, plain_bn->running_var));
  EXPECT_EQ(ckpt_bn->num_batches_tracked.item<int64_t>(), 1);
}

TEST(Checkpoint, SeveralOutputsCapturedArgumentsAndNonDifferentiableOutputs) {
  const auto w = at::randn({5, 5}).requires_grad_();
  const double scale = 0.5;  // a non-tensor argument, captured
  auto segment = [&](const std::vector<at::Tensor>& in) {
    auto y = in[0].matmul(w) * scale;
    return std::vector<at::Tensor>{y.tanh(), (y * in[1]).sum(), y.argmax(1)};
  };
  auto a = at::randn({3, 5}).requires_grad_(), b = at::randn({3, 5});
  auto outs = gpuops::checkpoint(segment, {a, b});
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_FALSE(outs[2].requires_grad());  // integer output
  (outs[0].sum() + outs[1]).backward();
  auto a2 = a.detach().clone().requires_grad_(true);
  auto w2 = w.detach().clone().requires_grad_(true);
  auto y = a2.matmul(w2) * scale;
  (y.tanh().sum() + (y * b).sum()).backward();
  EXPECT_TRUE(at::allclose(a.grad(), a2.grad()));
  EXPECT_TRUE(at::allclose(w.grad(), w2.grad()));
}

TEST(Checkpoint, ErrorsSayWhatToDo) {
  auto w = at::randn({4, 4}).requires_grad_();
  auto segment = [&](const at::Tensor& t) { return t.matmul(w); };
  // no input requiring grad: a warning and outputs that need no grad, as torch's reentrant checkpoint
  EXPECT_FALSE(gpuops::checkpoint(segment, at::randn({2, 4})).requires_grad());
  auto x = at::randn({2, 4}).requires_grad_();
  auto out = gpuops::checkpoint(segment, x).sum();
  try {  // w is not even an edge of the graph; torch's RuntimeError (c10::Error), in torch's words
    torch::autograd::grad({out}, {x});
    ADD_FAILURE() << "grad() with inputs through a checkpointed segment did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("torch.utils.checkpoint is incompatible"), std::string::npos) << e.what();
  }

  auto y = at::randn({2, 4}).requires_grad_().clone();  // a non-leaf input...
  auto out2 = gpuops::checkpoint(segment, y).sum();
  {
    at::NoGradGuard no_grad;
    y.add_(1);  // ...modified in place after the forward
  }
  EXPECT_THROW(out2.backward(), c10::Error);
}

TEST(Checkpoint, WithGradDisabledItSimplyRuns) {
  at::NoGradGuard no_grad;
  auto x = at::randn({3});
  EXPECT_TRUE(at::equal(gpuops::checkpoint([](const at::Tensor& t) { return t * 2; }, x), x * 2));
}

TEST(Checkpoint, AFailingRecomputationLeavesTheRngStateAndBuffersAsTheyWere) {
  int calls = 0;
  auto buffer = at::zeros({3});
  const gpuops::SegmentFn segment = [&](const std::vector<at::Tensor>& in) {
    buffer.add_(1);                                 // a running statistic, updated in place
    at::Tensor noisy = at::dropout(in[0], 0.5, true);  // consumes the CPU generator
    TORCH_CHECK(++calls < 2, "the segment fails in its recomputation");
    return std::vector<at::Tensor>{noisy * 2};
  };
  torch::manual_seed(3);
  auto x = at::randn({4, 5}).requires_grad_();
  gpuops::CheckpointOptions options;
  options.buffers = {buffer};
  auto out = gpuops::checkpoint(segment, {x}, options)[0].sum();
  at::randn({7});  // the caller's generator moves on after the forward
  const auto state = at::detail::getDefaultCPUGenerator().get_state();
  const auto buffer_before = buffer.clone();
  EXPECT_THROW(out.backward(), c10::Error);
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), state));
  EXPECT_TRUE(at::equal(buffer, buffer_before));
}

}  // namespace
