// MetricsRecorder from C++ (the Python suite, tests/python/test_metrics.py, checks each figure against a real run).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

#include "gpuops/telemetry.h"

namespace {

using gpuops::telemetry::MetricsRecorder;
using gpuops::telemetry::RecorderOptions;
using gpuops::telemetry::StepReport;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string temp_path(const char* name) {
  const std::string path = std::string(testing::TempDir()) + name + std::to_string(::getpid());
  std::remove(path.c_str());
  return path;
}

TEST(Telemetry, RecordsEachIntervalOnceAndContinuesAFile) {
  const std::string path = temp_path("metrics.jsonl");
  RecorderOptions options;
  options.log_every = 2;
  options.jsonl_path = path;
  {
    MetricsRecorder recorder(options);
    for (int64_t step = 1; step <= 3; ++step) {
      StepReport report;
      report.loss = at::full({}, static_cast<double>(step));
      report.lrs = {0.1};
      recorder.step_done(step, report);
    }
    EXPECT_EQ(recorder.host_reads(), 0);  // CPU values are read where they are: no device read
    const auto last = recorder.flush();     // step 3
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 3);
    EXPECT_EQ(last->figures.at(0).first, "loss");
    EXPECT_EQ(last->figures.at(0).second, 3.0);
  }
  EXPECT_EQ(read_text(path).substr(0, 22), R"({"step":2,"loss":1.5,")");
  MetricsRecorder resumed(options);  // a run resumed from step 2 reaches step 3 again: not written twice
  EXPECT_EQ(resumed.resumed_after(), 3);
  StepReport report;
  report.loss = at::full({}, 9.0);
  resumed.step_done(3, report);
  resumed.flush();
  std::istringstream lines(read_text(path));
  int count = 0;
  for (std::string line; std::getline(lines, line);) ++count;
  EXPECT_EQ(count, 2);
  std::remove(path.c_str());
}

TEST(Telemetry, RefusesBadInputNamingIt) {
  RecorderOptions options;
  options.log_every = 0;
  EXPECT_THROW(MetricsRecorder{options}, c10::ValueError);
  options.log_every = 1;
  MetricsRecorder recorder(options);
  StepReport report;
  report.loss = at::ones({2});
  try {
    recorder.step_done(1, report);
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("loss must be a one-element tensor"), std::string::npos);
  }
  report.loss = at::ones({});
  recorder.step_done(1, report);  // the refused call left no step behind
  EXPECT_THROW(recorder.step_done(1, report), c10::ValueError);  // steps must increase
}

}  // namespace
