// FlatParams: parameters and gradients become aligned views of one buffer per (device, dtype); training
// through them is bit-identical to training without; ZeRO shards; errors leave everything unchanged.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "gpuops/flat_params.h"

namespace {

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(7, 13), torch::nn::Tanh(), torch::nn::Linear(13, 3));
}

TEST(FlatParams, ParametersBecomeAlignedViewsWithTheirValues) {
  auto model = make_mlp();
  std::vector<at::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  gpuops::FlatParamsOptions options;
  options.world_size = 4;
  gpuops::FlatParams flat(model->parameters(), options);
  ASSERT_EQ(flat.buckets().size(), 1u);
  const auto& bucket = flat.buckets()[0];
  EXPECT_EQ(bucket.data.numel() % (4 * 4), 0);  // padded to world_size * 16 bytes of float
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i], before[i])) << i;
    EXPECT_EQ(bucket.slots[i].offset % 4, 0) << i;
    EXPECT_EQ(params[i].data_ptr(), static_cast<float*>(bucket.data.data_ptr()) + bucket.slots[i].offset) << i;
  }
  EXPECT_TRUE(flat.intact());
  int64_t covered = 0;
  for (int64_t r = 0; r < 4; ++r) covered += gpuops::FlatParams::shard(bucket.grad, r, 4).numel();
  EXPECT_EQ(covered, bucket.grad.numel());
  EXPECT_THROW(gpuops::FlatParams::shard(bucket.grad, 4, 4), c10::ValueError);
}

TEST(FlatParams, TrainingThroughTheViewsIsBitIdentical) {
  auto plain = make_mlp(), flattened = make_mlp();
  gpuops::FlatParams flat(flattened->parameters());
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD flat_sgd(flattened->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    const auto x = at::randn({16, 7});
    plain_sgd.zero_grad();
    flat.zero_grad();
    plain->forward(x).square().sum().backward();
    flattened->forward(x).square().sum().backward();
    ASSERT_TRUE(flat.intact()) << "backward replaced a gradient view";
    // the flat gradient buffer holds every gradient: its norm is theirs
    double squares = 0;
    for (const auto& p : plain->parameters()) squares += p.grad().to(at::kDouble).square().sum().item<double>();
    EXPECT_NEAR(flat.buckets()[0].grad.to(at::kDouble).norm().item<double>(), std::sqrt(squares), 1e-9 * std::sqrt(squares));
    plain_sgd.step();
    flat_sgd.step();
  }
  const auto a = plain->parameters(), b = flattened->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
  flat_sgd.zero_grad();  // set_to_none: the views are gone...
  EXPECT_FALSE(flat.intact());
  flat.zero_grad();  // ...and back
  EXPECT_TRUE(flat.intact());
}

TEST(FlatParams, OneBucketPerDtypeAndBadInputChangesNothing) {
  auto w = at::randn({5}).requires_grad_(), h = at::randn({3}, at::kDouble).requires_grad_();
  gpuops::FlatParams flat({w, h});
  EXPECT_EQ(flat.buckets().size(), 2u);

  auto a = at::randn({4, 4}).requires_grad_();
  const void* where = a.data_ptr();
  const auto not_leaf = (a * 2);
  EXPECT_THROW(gpuops::FlatParams({a, not_leaf}), c10::ValueError);
  EXPECT_THROW(gpuops::FlatParams({a, a}), c10::ValueError);
  EXPECT_THROW(gpuops::FlatParams({a, at::randn({4, 4}).t().requires_grad_()}), c10::ValueError);
  EXPECT_THROW(gpuops::FlatParams({}), c10::ValueError);
  gpuops::FlatParamsOptions odd;
  odd.alignment_bytes = 12;
  EXPECT_THROW(gpuops::FlatParams({a}, odd), c10::ValueError);
  EXPECT_EQ(a.data_ptr(), where);  // untouched by every failed construction
}

TEST(FlatParams, AWrongGradientIsRefusedBeforeAnyParameterMoves) {
  auto q = at::randn({6}).requires_grad_(), p = at::randn({2, 3}).requires_grad_();
  const auto q_values = q.detach().clone(), p_values = p.detach().clone();
  q.mutable_grad() = at::randn({6});
  for (const auto& bad : {at::randn({3, 2}), at::randn({2, 3}, at::kDouble), at::randn({6}).to_sparse()}) {
    p.mutable_grad() = bad;
    const void *q_where = q.data_ptr(), *q_grad = q.grad().data_ptr(), *p_where = p.data_ptr();
    try {
      gpuops::FlatParams({q, p});
      ADD_FAILURE() << "no error";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("params[1].grad"), std::string::npos) << e.what();
    }
    EXPECT_EQ(q.data_ptr(), q_where);  // params[0] was checked first and still not moved
    EXPECT_EQ(q.grad().data_ptr(), q_grad);
    EXPECT_EQ(p.data_ptr(), p_where);
    EXPECT_TRUE(at::equal(q.detach(), q_values) && at::equal(p.detach(), p_values));
  }
}

TEST(FlatParams, AHugeAlignmentOrWorldSizeIsAClearError) {
  auto a = at::randn({5}).requires_grad_();
  const void* where = a.data_ptr();
  for (int64_t alignment : {int64_t{1} << 13, int64_t{1} << 40, INT64_MIN, int64_t{-16}}) {
    gpuops::FlatParamsOptions o;
    o.alignment_bytes = alignment;
    try {
      gpuops::FlatParams({a}, o);
      ADD_FAILURE() << alignment;
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("alignment_bytes must be a power of two in [1, 4096]"), std::string::npos)
          << e.what();
    }
  }
  for (int64_t world : {(int64_t{1} << 20) + 1, int64_t{1} << 40, INT64_MAX, int64_t{0}}) {
    gpuops::FlatParamsOptions o;
    o.world_size = world;
    try {
      gpuops::FlatParams({a}, o);
      ADD_FAILURE() << world;
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("world_size must be in [1, 1048576]"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(a.data_ptr(), where);
  gpuops::FlatParamsOptions widest;  // the limits themselves are accepted
  widest.alignment_bytes = 4096;
  widest.world_size = 4;
  gpuops::FlatParams flat({a}, widest);
  EXPECT_EQ(flat.buckets()[0].data.numel() % (1024 * 4), 0);
}

}  // namespace

// torch's C++ Module::load set_s the loaded tensors into the parameters: reattach copies them back into the
// buffers and makes the parameters views again; a tensor of another shape is refused with nothing changed.
TEST(FlatParams, ReattachPutsLoadedParametersBackIntoTheBuffer) {
  torch::nn::Sequential model(torch::nn::Linear(5, 7), torch::nn::Linear(7, 2));
  torch::nn::Sequential saved(torch::nn::Linear(5, 7), torch::nn::Linear(7, 2));
  gpuops::FlatParams flat(model->parameters());
  ASSERT_TRUE(flat.intact());
  std::stringstream bytes;
  torch::save(saved, bytes);
  torch::load(model, bytes);
  ASSERT_FALSE(flat.intact());  // the parameters now live elsewhere
  EXPECT_EQ(flat.reattach(), 4);
  EXPECT_TRUE(flat.intact());
  EXPECT_EQ(flat.reattach(), 0);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(model->parameters()[i], saved->parameters()[i])) << i;
  const auto& slot = flat.buckets()[0].slots[1];
  EXPECT_TRUE(at::equal(flat.buckets()[0].data.narrow(0, slot.offset, slot.numel), saved->parameters()[1]));
  {
    at::NoGradGuard no_grad;
    model->parameters()[2].set_(at::zeros({3, 3}));
  }
  EXPECT_THROW(flat.reattach(), c10::ValueError);
  EXPECT_TRUE(at::equal(model->parameters()[0], saved->parameters()[0]));
}
