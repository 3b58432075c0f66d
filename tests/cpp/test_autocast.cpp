// AutocastGuard behaves as torch.autocast: casts inside, nests, restores, refuses bad arguments.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

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

}  // namespace
