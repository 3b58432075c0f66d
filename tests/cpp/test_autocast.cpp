// AutocastGuard behaves as torch.autocast: casts inside, nests, restores, refuses bad arguments.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "gpuops/autocast.h"

namespace {

using gpuops::amp::AutocastGuard;

TEST(AutocastGuard, MatmulRunsInTheLowPrecisionDtypeAndMatchesAFloat64Reference) {
  const auto a = at::randn({33, 65}), b = at::randn({65, 17});
  at::Tensor out;
  {
    AutocastGuard guard(c10::DeviceType::CPU, at::kBFloat16);
    out = at::matmul(a, b);
  }
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  const auto reference = at::matmul(a.to(at::kBFloat16).to(at::kDouble), b.to(at::kBFloat16).to(at::kDouble));
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), reference, 2e-2, 5e-2));
  EXPECT_EQ(at::matmul(a, b).scalar_type(), at::kFloat);  // the guard is gone
}

TEST(AutocastGuard, NestingAndDisablingRestoreTheOuterState) {
  const auto a = at::randn({8, 8});
  {
    AutocastGuard outer(c10::DeviceType::CPU, at::kBFloat16);
    {
      AutocastGuard inner(c10::DeviceType::CPU, at::kHalf);
      EXPECT_EQ(at::matmul(a, a).scalar_type(), at::kHalf);
      {
        AutocastGuard off(c10::DeviceType::CPU, at::kHalf, /*enabled=*/false);
        EXPECT_EQ(at::matmul(a, a).scalar_type(), at::kFloat);
      }
      EXPECT_EQ(at::matmul(a, a).scalar_type(), at::kHalf);
    }
    EXPECT_EQ(at::matmul(a, a).scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
}

TEST(AutocastGuard, CacheSettingIsRestored) {
  const bool before = at::autocast::is_autocast_cache_enabled();
  {
    AutocastGuard guard(c10::DeviceType::CPU, at::kBFloat16, true, /*cache_enabled=*/!before);
    EXPECT_EQ(at::autocast::is_autocast_cache_enabled(), !before);
  }
  EXPECT_EQ(at::autocast::is_autocast_cache_enabled(), before);
}

TEST(AutocastGuard, RejectsADtypeOutsideFloat16AndBfloat16) {
  try {
    AutocastGuard guard(c10::DeviceType::CPU, at::kFloat);
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("dtype"), std::string::npos);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));  // nothing half-changed
}

TEST(AutocastGuard, GuardsEndingOutOfOrderLeaveTheStateBeforeTheFirst) {
  const auto cpu = c10::DeviceType::CPU;
  const auto dtype_before = at::autocast::get_autocast_dtype(cpu);
  const bool cache_before = at::autocast::is_autocast_cache_enabled();
  const auto a = at::randn({8, 8});
  // Every order of ending three guards (enabled, disabled, enabled with another dtype and cache flag).
  std::vector<int> order{0, 1, 2};
  do {
    std::vector<std::unique_ptr<AutocastGuard>> guards;
    guards.push_back(std::make_unique<AutocastGuard>(cpu, at::kBFloat16, true));
    guards.push_back(std::make_unique<AutocastGuard>(cpu, at::kHalf, false, !cache_before));
    guards.push_back(std::make_unique<AutocastGuard>(cpu, at::kHalf, true));
    EXPECT_EQ(at::matmul(a, a).scalar_type(), at::kHalf);
    for (size_t i = 0; i < order.size(); ++i) {
      guards[order[i]].reset();
      int newest = -1;  // the newest guard still alive is the one in force
      for (int g = 2; g >= 0 && newest < 0; --g)
        if (guards[g]) newest = g;
      const auto expected = newest < 0 ? at::kFloat : (newest == 0 ? at::kBFloat16 : (newest == 1 ? at::kFloat : at::kHalf));
      EXPECT_EQ(at::matmul(a, a).scalar_type(), expected) << order[0] << order[1] << order[2] << " after " << i;
    }
    EXPECT_FALSE(at::autocast::is_autocast_enabled(cpu));
    EXPECT_EQ(at::autocast::get_autocast_dtype(cpu), dtype_before);
    EXPECT_EQ(at::autocast::is_autocast_cache_enabled(), cache_before);
  } while (std::next_permutation(order.begin(), order.end()));
}

}  // namespace
