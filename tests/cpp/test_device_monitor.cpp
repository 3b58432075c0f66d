// gpuops::telemetry::DeviceMonitor against a stand-in NVML (fake_nvml.cpp, whose figures are known): the
// figures of an interval (means of the rates, maxima of the levels, the energy between readings), the GPU found
// by PCI bus id or index, nothing but NaN and a reason without NVML or that GPU, and MetricsRecorder's records
// holding them with the energy per token.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <chrono>
#include <string>
#include <thread>

#include <c10/util/Exception.h>

#include "gpuops/device_monitor.h"
#include "gpuops/telemetry.h"

namespace {

using gpuops::telemetry::DeviceMonitor;

struct NvmlLibrary {  // GPUOPS_NVML_LIBRARY for one test
  explicit NvmlLibrary(const char* path) { setenv("GPUOPS_NVML_LIBRARY", path, 1); }
  ~NvmlLibrary() { unsetenv("GPUOPS_NVML_LIBRARY"); }
};

TEST(DeviceMonitor, FiguresOfAnIntervalFromNvml) {
  NvmlLibrary fake(GPUOPS_FAKE_NVML);
  DeviceMonitor monitor("00000000:3B:00.0", 3600);  // the thread never samples: every reading is take()'s
  ASSERT_TRUE(monitor.available()) << monitor.reason();
  const auto f = monitor.take();  // readings 1 (construction) and 2
  EXPECT_EQ(f.samples, 2);
  EXPECT_DOUBLE_EQ(f.util_pct, (20 + 30) / 2.0);
  EXPECT_DOUBLE_EQ(f.memory_used_bytes, (1 << 30) + 2.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(f.temperature_c, 42);
  EXPECT_DOUBLE_EQ(f.power_w, 150);
  EXPECT_DOUBLE_EQ(f.sm_clock_mhz, 1410);
  EXPECT_DOUBLE_EQ(f.energy_j, 2);  // 4000 mJ - 2000 mJ
  const auto g = monitor.take();    // reading 3 only: the interval starts where the last ended
  EXPECT_EQ(g.samples, 1);
  EXPECT_DOUBLE_EQ(g.energy_j, 2);
  EXPECT_DOUBLE_EQ(g.util_pct, 40);
}

TEST(DeviceMonitor, ItsThreadSamplesBetweenTakes) {
  NvmlLibrary fake(GPUOPS_FAKE_NVML);
  DeviceMonitor monitor("0", 0.01);  // by NVML index
  ASSERT_TRUE(monitor.available()) << monitor.reason();
  monitor.take();
  int64_t samples = 0;
  for (int i = 0; i < 200 && samples < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    samples += monitor.take().samples - 1;  // beyond take()'s own reading
  }
  EXPECT_GE(samples, 3);
}

TEST(DeviceMonitor, WithoutNvmlOrThatGpuEverythingIsNan) {
  {
    NvmlLibrary absent("/nonexistent/libnvidia-ml.so.1");
    DeviceMonitor monitor("0", 1);
    EXPECT_FALSE(monitor.available());
    EXPECT_NE(monitor.reason().find("NVML not loaded"), std::string::npos) << monitor.reason();
    const auto f = monitor.take();
    EXPECT_TRUE(std::isnan(f.util_pct) && std::isnan(f.energy_j) && std::isnan(f.power_w));
    EXPECT_EQ(f.samples, 0);
  }
  NvmlLibrary fake(GPUOPS_FAKE_NVML);
  DeviceMonitor other("00000000:AA:00.0", 1);
  EXPECT_FALSE(other.available());
  EXPECT_NE(other.reason().find("knows no GPU '00000000:AA:00.0'"), std::string::npos) << other.reason();
  EXPECT_FALSE(DeviceMonitor("99999999999999999999", 1).available());  // no overflow: not found
  EXPECT_FALSE(DeviceMonitor("", 1).available());
  EXPECT_THROW(DeviceMonitor("0", 0), c10::ValueError);
  EXPECT_THROW(DeviceMonitor("0", std::nan("")), c10::ValueError);
}

TEST(DeviceMonitor, RecordsHoldTheFiguresAndTheEnergyPerToken) {
  NvmlLibrary fake(GPUOPS_FAKE_NVML);
  gpuops::telemetry::RecorderOptions options;
  options.log_every = 2;
  options.gpu = "0";
  options.gpu_sample_s = 3600;
  std::optional<gpuops::telemetry::Record> last;
  gpuops::telemetry::MetricsRecorder recorder(options, [&](const gpuops::telemetry::Record& r) { last = r; });
  gpuops::telemetry::StepReport report;
  report.tokens = 500;
  recorder.step_done(1, report);
  recorder.step_done(2, report);
  ASSERT_TRUE(last.has_value());
  const auto figure = [&](const std::string& name) {
    for (const auto& [n, v] : last->figures)
      if (n == name) return v;
    ADD_FAILURE() << name << " not in the record";
    return std::nan("");
  };
  EXPECT_DOUBLE_EQ(figure("gpu_power_w"), 150);
  EXPECT_DOUBLE_EQ(figure("gpu_sm_clock_mhz"), 1410);
  EXPECT_DOUBLE_EQ(figure("gpu_energy_j"), 2);  // two readings: construction's and the record's
  EXPECT_DOUBLE_EQ(figure("joules_per_token"), 2.0 / 1000);
  EXPECT_GT(figure("gpu_memory_used_bytes"), 1 << 30);
  options.gpu_sample_s = -1;
  EXPECT_THROW(gpuops::telemetry::MetricsRecorder bad(options), c10::ValueError);
}

}  // namespace
