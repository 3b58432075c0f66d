// MetricsRecorder from C++ (the Python suite, tests/python/test_metrics.py, checks each figure against a real run).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
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

namespace {

// A connection to 127.0.0.1:port with `request` sent (-1 when either failed).
int send_request(int64_t port, const std::string& request) {
  const int sock = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (sock < 0 || ::connect(sock, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::send(sock, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    if (sock >= 0) ::close(sock);
    return -1;
  }
  return sock;
}

}  // namespace

// Scrapers that hang up before reading a large page cost their scrape only: the process (C++ does not ignore SIGPIPE
// as Python does) goes on, and the endpoint serves the next scrape whole. (cpp-httplib checks that a peer is alive
// before each write, so SIGPIPE needs a peer closing inside that window; the endpoint's threads block it anyway,
// which this test cannot force.)
TEST(Telemetry, ScrapersHangingUpLeaveTheEndpointServing) {
  if (!gpuops::telemetry::prometheus_available()) GTEST_SKIP() << "built without cpp-httplib";
  RecorderOptions options;
  options.log_every = 1;
  options.prometheus_port = 0;
  MetricsRecorder recorder(options);
  StepReport report;
  report.lrs.assign(200000, 1e-3);  // a page of megabytes, written in many sends
  recorder.step_done(1, report);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int sock = send_request(recorder.prometheus_port(), "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    ASSERT_GE(sock, 0);
    ::close(sock);  // gone before the page: the server's first write draws a reset, its next one EPIPE
    ::usleep(100000);
  }
  report.lrs = {1e-3};
  recorder.step_done(2, report);  // still here, and still serving: a whole scrape of the new page
  const int sock =
      send_request(recorder.prometheus_port(), "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  ASSERT_GE(sock, 0);
  std::string page;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(sock, buffer, sizeof buffer, 0)) > 0;) page.append(buffer, static_cast<size_t>(n));
  ::close(sock);
  EXPECT_NE(page.find("200 OK"), std::string::npos) << page.substr(0, 200);
  EXPECT_NE(page.find("gpuops_step{job=\"gpuops\",rank=\"0\",world_size=\"1\"} 2\n"), std::string::npos);
  EXPECT_FALSE(recorder.close());  // (the record of step 2 was made at its step)
}
