// MemoryBudget on the CPU: counts what autograd really allocates and fails past the limit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include "gpuops/memory_budget.h"

namespace {

using gpuops::MemoryBudget;

// A two-layer MLP step whose allocation total we can count by hand: the tensors are float32.
at::Tensor mlp_loss(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
  return at::relu(at::matmul(x, w1)).matmul(w2).pow(2).sum();
}

TEST(MemoryBudget, CountsAParameterSizedAllocationExactly) {
  MemoryBudget budget;
  const int64_t rows = 37 + at::randint(0, 64, {1}).item<int64_t>();
  auto t = at::empty({rows, 129}, at::kFloat);
  EXPECT_EQ(budget.current_bytes(), rows * 129 * 4);
  EXPECT_EQ(budget.peak_bytes(), rows * 129 * 4);
  t.reset();
  EXPECT_EQ(budget.current_bytes(), 0);
  EXPECT_EQ(budget.peak_bytes(), rows * 129 * 4);
}

TEST(MemoryBudget, PeakOfBackwardCoversSavedActivationsAndGradients) {
  const auto x = at::randn({64, 256});
  const auto w1 = at::randn({256, 512}).requires_grad_();
  const auto w2 = at::randn({512, 1}).requires_grad_();
  MemoryBudget budget;
  mlp_loss(x, w1, w2).backward();
  // Lower bound that must hold: the gradients (kept) plus the saved hidden activation (64x512).
  const int64_t grads = (256 * 512 + 512) * 4;
  EXPECT_GE(budget.current_bytes(), grads);
  EXPECT_GE(budget.peak_bytes(), grads + 64 * 512 * 4);
  EXPECT_LT(budget.peak_bytes(), 8 * (grads + 64 * 512 * 4));  // and nothing wildly off
}

TEST(MemoryBudget, ThrowsOutOfMemoryErrorPastTheLimitInsideBackward) {
  const auto x = at::randn({64, 256});
  const auto w1 = at::randn({256, 512}).requires_grad_();
  const auto w2 = at::randn({512, 1}).requires_grad_();
  // Enough for the forward (hidden activations) but not for the gradient of w1 as well.
  MemoryBudget budget(64 * 512 * 4 * 2 + 4096 + 256 * 512 * 2);
  auto loss = mlp_loss(x, w1, w2);
  EXPECT_THROW(loss.backward(), c10::OutOfMemoryError);
  EXPECT_GE(budget.stats().failed_allocations, 1);
}

TEST(MemoryBudget, NothingIsCountedOrRefusedAfterTheScopeEnds) {
  c10::Allocator* before = c10::GetAllocator(c10::kCPU);
  at::Tensor kept;
  {
    MemoryBudget budget(1 << 20);
    kept = at::ones({1000});
    EXPECT_THROW(at::empty({1 << 20}), c10::OutOfMemoryError);
  }
  EXPECT_EQ(c10::GetAllocator(c10::kCPU), before);
  auto big = at::empty({1 << 20});  // would exceed the old limit
  kept.resize_({1 << 18});          // storage made under the budget still resizes after it
  EXPECT_EQ(kept.numel(), 1 << 18);
}

TEST(MemoryBudget, RawAllocationsThroughACachedAllocatorPointerWorkBeforeDuringAndAfter) {
  c10::Allocator* cached = nullptr;
  void* made_inside = nullptr;
  {
    MemoryBudget budget;
    cached = c10::GetAllocator(c10::kCPU);  // code that caches the allocator while a budget is active
    made_inside = cached->raw_allocate(256);
    EXPECT_EQ(budget.current_bytes(), 256);
  }
  void* made_after = cached->raw_allocate(512);  // forwarded: no budget is active
  cached->raw_deallocate(made_after);
  cached->raw_deallocate(made_inside);
  MemoryBudget budget;
  void* made_in_new_budget = cached->raw_allocate(128);
  EXPECT_EQ(budget.current_bytes(), 128);
  cached->raw_deallocate(made_in_new_budget);
  EXPECT_EQ(budget.current_bytes(), 0);
}

TEST(MemoryBudget, RestoresTheAllocatorWhenAnExceptionUnwinds) {
  c10::Allocator* before = c10::GetAllocator(c10::kCPU);
  try {
    MemoryBudget budget(1024);
    at::empty({4096});
    FAIL() << "expected an OutOfMemoryError";
  } catch (const c10::OutOfMemoryError&) {
  }
  EXPECT_EQ(c10::GetAllocator(c10::kCPU), before);
}

TEST(MemoryBudget, NestedBudgetsCountInBothAndTheTighterOneFails) {
  MemoryBudget outer(10 << 20);
  auto a = at::empty({1 << 18});  // 1 MiB
  {
    MemoryBudget inner(2 << 20);
    auto b = at::empty({1 << 18});
    EXPECT_EQ(inner.current_bytes(), 1 << 20);
    EXPECT_EQ(outer.current_bytes(), 2 << 20);
    EXPECT_THROW(at::empty({1 << 19}), c10::OutOfMemoryError);  // 2 MiB more breaks the inner limit
  }
  EXPECT_EQ(outer.current_bytes(), 1 << 20);
  auto c = at::empty({1 << 19});  // fine under the outer limit alone
  EXPECT_EQ(outer.current_bytes(), 3 << 20);
}

TEST(MemoryBudget, ResetPeakStartsFromTheCurrentValue) {
  MemoryBudget budget;
  { auto big = at::empty({1 << 16}); }
  EXPECT_EQ(budget.peak_bytes(), 1 << 18);
  auto small = at::empty({16});
  budget.reset_peak();
  EXPECT_EQ(budget.peak_bytes(), 64);
}

TEST(MemoryBudget, RejectsANonPositiveLimitNamingTheArgument) {
  try {
    MemoryBudget budget(0);
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("limit_bytes"), std::string::npos);
  }
  EXPECT_THROW(MemoryBudget(-5), c10::ValueError);
  EXPECT_THROW(MemoryBudget(100, c10::Device(c10::kMeta)), c10::ValueError);
}

}  // namespace
