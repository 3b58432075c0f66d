// The AMP ops against torch's own (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include <ATen/ATen.h>

#include "gpuops/amp.h"

namespace {

std::mt19937& rng() {
  static std::mt19937 generator(std::random_device{}());
  return generator;
}

// Gradients of odd sizes in every accepted dtype, scaled like real AMP gradients.
std::vector<at::Tensor> random_grads(at::ScalarType dtype, const at::Device& device) {
  std::vector<at::Tensor> grads;
  for (int64_t n : {1, 7, 1000, 65537, 3 * 65536 + 5, 2 * 65536 + 8}) {
    grads.push_back((at::randn({n}) * 1024).to(device, dtype));
  }
  return grads;
}

void expect_unscale_matches_torch(at::ScalarType dtype, const at::Device& device, bool inject_nonfinite) {
  auto ours = random_grads(dtype, device);
  if (inject_nonfinite) {
    std::uniform_int_distribution<size_t> pick(0, ours.size() - 1);
    auto& victim = ours[pick(rng())];
    victim.view(-1)[std::uniform_int_distribution<int64_t>(0, victim.numel() - 1)(rng())] =
        (rng()() % 2) ? INFINITY : NAN;
  }
  // torch's CUDA op takes no bfloat16 (its GradScaler refuses bf16 gradients): that reference runs on the CPU.
  const at::Device reference_device = dtype == at::kBFloat16 ? at::Device(at::kCPU) : device;
  std::vector<at::Tensor> reference;
  for (const auto& g : ours) reference.push_back(g.to(reference_device, /*non_blocking=*/false, /*copy=*/true));
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto inv_scale = at::full({1}, 1.0f / 4096.0f, options);
  auto found_ours = at::zeros({1}, options), found_ref = at::zeros({1}, options.device(reference_device));

  gpuops::amp::unscale_and_check_(ours, found_ours, inv_scale);
  at::_amp_foreach_non_finite_check_and_unscale_(reference, found_ref, inv_scale.to(reference_device));

  EXPECT_EQ(found_ours.item<float>(), found_ref.item<float>());
  EXPECT_EQ(found_ours.item<float>(), inject_nonfinite ? 1.0f : 0.0f);
  for (size_t i = 0; i < ours.size(); ++i) {
    const auto mine = ours[i].to(reference_device);
    EXPECT_TRUE(at::equal(mine.isnan(), reference[i].isnan()));
    const auto finite = reference[i].isfinite();
    EXPECT_TRUE(at::equal(mine.masked_select(finite), reference[i].masked_select(finite))) << "tensor " << i;
  }
}

TEST(AmpUnscale, MatchesTorchBitwiseOnTheCpuForEveryDtype) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    expect_unscale_matches_torch(dtype, at::kCPU, false);
    expect_unscale_matches_torch(dtype, at::kCPU, true);
  }
}

TEST(AmpUnscale, MatchesTorchOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device";
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    expect_unscale_matches_torch(dtype, at::Device(at::kCUDA, 0), false);
    expect_unscale_matches_torch(dtype, at::Device(at::kCUDA, 0), true);
  }
}

TEST(AmpUnscale, RejectsBadInputNamingItAndLeavesGradientsUntouched) {
  auto good = at::randn({10});
  const auto before = good.clone();
  auto found = at::zeros({1}), inv = at::full({1}, 0.5f);
  EXPECT_THROW(gpuops::amp::unscale_and_check_({good, at::ones({3}, at::kInt)}, found, inv), c10::ValueError);
  // an expanded view: elements sharing memory cannot be written in place (strided views and float64 are taken)
  EXPECT_THROW(gpuops::amp::unscale_and_check_({good, at::randn({1, 4}).expand({3, 4})}, found, inv), c10::ValueError);
  EXPECT_THROW(gpuops::amp::unscale_and_check_({good}, at::zeros({2}), inv), c10::ValueError);
  EXPECT_THROW(gpuops::amp::unscale_and_check_({good}, found, at::full({1}, 0.5, at::kDouble)), c10::ValueError);
  const auto sparse = at::eye(3).to_sparse();
  try {
    gpuops::amp::unscale_and_check_({good, sparse}, found, inv);
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("sparse"), std::string::npos);
  }
  EXPECT_TRUE(at::equal(good, before));  // checks run before anything is written
  EXPECT_EQ(found.item<float>(), 0.0f);
}

// A scripted run of overflows and clean steps, ours against torch's op (hysteresis 1 = torch semantics).
TEST(AmpScaleUpdate, MatchesTorchStepByStep) {
  gpuops::amp::ScaleUpdateOptions options;
  options.growth_interval = 3;
  auto scale = at::full({1}, 65536.0f), ref_scale = scale.clone();
  auto tracker = at::zeros({1}, at::kInt), ref_tracker = tracker.clone();
  auto hysteresis = at::ones({1}, at::kInt);
  std::bernoulli_distribution overflow(0.3);
  for (int step = 0; step < 200; ++step) {
    const auto found = at::full({1}, overflow(rng()) ? 1.0f : 0.0f);
    gpuops::amp::update_scale_(scale, tracker, hysteresis, found, options);
    at::_amp_update_scale_(ref_scale, ref_tracker, found, options.growth_factor, options.backoff_factor,
                           options.growth_interval);
    ASSERT_EQ(scale.item<float>(), ref_scale.item<float>()) << "step " << step;
    ASSERT_EQ(tracker.item<int>(), ref_tracker.item<int>()) << "step " << step;
  }
}

TEST(AmpScaleUpdate, HysteresisDelaysTheBackoffAndMinMaxClamp) {
  gpuops::amp::ScaleUpdateOptions options;
  options.growth_interval = 2;
  options.hysteresis = 2;
  options.min_scale = 1000.0;
  options.max_scale = 5000.0;
  auto scale = at::full({1}, 2048.0f);
  auto tracker = at::zeros({1}, at::kInt);
  auto hysteresis = at::full({1}, 2, at::kInt);
  auto step = [&](bool inf) {
    gpuops::amp::update_scale_(scale, tracker, hysteresis, at::full({1}, inf ? 1.0f : 0.0f), options);
    return scale.item<float>();
  };
  EXPECT_EQ(step(true), 2048.0f);  // first overflow: tolerated
  EXPECT_EQ(step(true), 1024.0f);  // second in a row: back off
  EXPECT_EQ(step(true), 1000.0f);  // clamped at min_scale
  EXPECT_EQ(step(false), 1000.0f);
  EXPECT_EQ(step(false), 2000.0f);  // growth_interval clean steps
  EXPECT_EQ(step(false), 2000.0f);
  EXPECT_EQ(step(false), 4000.0f);
  EXPECT_EQ(step(false), 4000.0f);
  EXPECT_EQ(step(false), 5000.0f);  // clamped at max_scale
  EXPECT_EQ(step(true), 5000.0f);   // the growth restored the hysteresis budget
  EXPECT_EQ(step(false), 5000.0f);  // a clean step between overflows does not restore it (DeepSpeed)
  EXPECT_EQ(step(true), 2500.0f);
}

TEST(AmpScaleUpdate, RejectsBadOptionsNamingThem) {
  auto scale = at::full({1}, 1.0f);
  auto tracker = at::zeros({1}, at::kInt), hysteresis = at::ones({1}, at::kInt), found = at::zeros({1});
  gpuops::amp::ScaleUpdateOptions bad;
  bad.backoff_factor = 1.5;
  try {
    gpuops::amp::update_scale_(scale, tracker, hysteresis, found, bad);
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("backoff_factor"), std::string::npos);
  }
  EXPECT_THROW(gpuops::amp::update_scale_(scale, at::zeros({1}), hysteresis, found, {}), c10::ValueError);
  EXPECT_EQ(scale.item<float>(), 1.0f);
}

}  // namespace
