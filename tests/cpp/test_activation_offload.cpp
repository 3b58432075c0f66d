// gpuops::ActivationOffloader, the store behind Python's offload_activations, driven directly (LibTorch's
// saved-tensor hooks take Python callables only): values back bit for bit, the host copies outside a
// MemoryBudget and the device copies inside it, one copy for a tensor saved twice, prefetch in the backward's
// order, a change in place refused, releases freeing everything, and bad arguments refused by name.
#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "gpuops/activation_offload.h"
#include "gpuops/memory_budget.h"

namespace {

using gpuops::ActivationOffloader;

TEST(ActivationOffloader, ValuesComeBackInTheBackwardsOrderWithPrefetch) {
  ActivationOffloader store({/*min_bytes=*/64, /*prefetch=*/1});
  std::vector<at::Tensor> saved;
  for (int64_t layer = 0; layer < 3; ++layer) {
    saved.push_back(at::randn({32, 16}));
    saved.push_back(at::randn({16, 32}).t());  // a transposed view: its layout kept
  }
  std::vector<int64_t> handles;
  gpuops::MemoryBudget budget;  // stands for the device
  for (int64_t layer = 0; layer < 3; ++layer) {
    store.enter_layer(layer);
    for (size_t i = 2 * layer; i < 2 * layer + 2; ++i) handles.push_back(store.pack(saved[i]));
    store.leave_layer();
  }
  EXPECT_EQ(budget.current_bytes(), 0);  // the host copies are outside the budget
  EXPECT_EQ(store.host_bytes(), 6 * 32 * 16 * 4);
  EXPECT_EQ(store.pack(at::randn({32, 16})), -1);  // no layer entered: kept
  store.enter_layer(0);
  EXPECT_EQ(store.pack(at::randn({4})), -1);  // under min_bytes: kept
  store.leave_layer();
  for (size_t i = handles.size(); i-- > 0;) {  // the backward: the last layer first
    const at::Tensor back = store.unpack(handles[i]);
    EXPECT_TRUE(at::equal(back, saved[i])) << i;
    EXPECT_EQ(back.strides(), saved[i].strides()) << i;
  }
  EXPECT_GT(budget.current_bytes(), 0);  // brought back: the device's bytes again
  std::vector<std::string> whats;
  std::vector<int64_t> layers;
  for (const auto& e : store.timeline())
    if (e.what != "to host") {
      whats.push_back(e.what);
      layers.push_back(e.layer);
    }
  EXPECT_EQ(whats, (std::vector<std::string>{"back on demand", "back on demand", "prefetch", "prefetch", "prefetch",
                                             "prefetch"}));
  EXPECT_EQ(layers, (std::vector<int64_t>{2, 2, 1, 1, 0, 0}));
  for (const int64_t h : handles) store.release(h);
  EXPECT_EQ(store.entries(), 0u);
  EXPECT_EQ(store.host_bytes(), 0);
  EXPECT_EQ(budget.current_bytes(), 0);
}

TEST(ActivationOffloader, OneCopyForATensorSavedTwiceAndAChangeInPlaceRefused) {
  ActivationOffloader store;
  store.enter_layer(0);
  at::Tensor x = at::randn({64, 64});
  const int64_t first = store.pack(x), again = store.pack(x);
  EXPECT_EQ(first, again);
  EXPECT_EQ(store.entries(), 1u);
  store.release(first);
  EXPECT_EQ(store.entries(), 1u);  // one use left
  x.add_(1);
  const int64_t after_change = store.pack(x);  // another version: another copy
  EXPECT_NE(after_change, first);
  EXPECT_TRUE(at::equal(store.unpack(after_change), x));
  try {
    store.unpack(again);
    FAIL() << "a change in place after the save was not refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"), std::string::npos) << e.what();
  }
  store.release(again);
  store.release(after_change);
  EXPECT_EQ(store.entries(), 0u);
  store.release(12345);  // unknown: ignored (a release after clear())
}

TEST(ActivationOffloader, BadArgumentsAreRefusedByName) {
  EXPECT_THROW(ActivationOffloader({/*min_bytes=*/-1, /*prefetch=*/1}), c10::ValueError);
  EXPECT_THROW(ActivationOffloader({/*min_bytes=*/0, /*prefetch=*/65}), c10::ValueError);
  ActivationOffloader store;
  EXPECT_THROW(store.enter_layer(-1), c10::ValueError);
  EXPECT_THROW(store.unpack(0), c10::ValueError);
}

}  // namespace
