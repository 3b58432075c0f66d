// device_info(): LOCAL_RANK parsing and the CPU fallback.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "gpuops/device.h"

namespace {

TEST(Device, LocalRankSelectsTheDeviceAndOneVisibleDeviceServesAnyRank) {
  EXPECT_EQ(gpuops::device_index_for_local_rank(std::nullopt, 4), 0);
  EXPECT_EQ(gpuops::device_index_for_local_rank("3", 4), 3);
  EXPECT_EQ(gpuops::device_index_for_local_rank("5", 1), 0);  // scheduler pinned one GPU per process
  EXPECT_THROW(gpuops::device_index_for_local_rank("4", 4), c10::ValueError);
  EXPECT_THROW(gpuops::device_index_for_local_rank("-1", 4), c10::ValueError);
  EXPECT_THROW(gpuops::device_index_for_local_rank("2a", 4), c10::ValueError);
  EXPECT_THROW(gpuops::device_index_for_local_rank("", 4), c10::ValueError);
}

TEST(Device, ReportsTheCpuWhenNoCudaDeviceIsVisible) {
  setenv("CUDA_VISIBLE_DEVICES", "", 1);  // hides every GPU from this process's CUDA runtime
  const auto info = gpuops::device_info();
  EXPECT_EQ(info.type, "cpu");
  EXPECT_EQ(info.visible_device_count, 0);
  EXPECT_GT(info.total_memory_bytes, int64_t{1} << 28);
  EXPECT_GT(info.free_memory_bytes, 0);
  EXPECT_LE(info.free_memory_bytes, info.total_memory_bytes);
  EXPECT_GE(info.multiprocessors, 1);
  EXPECT_FALSE(info.name.empty());
  EXPECT_THROW(gpuops::device_info(1), c10::ValueError);
}

}  // namespace
