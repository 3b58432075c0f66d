// MetricsRecorder from C++ (the Python suite, tests/python/test_metrics.py, checks each figure against a real run).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <dirent.h>
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

// CRC-32C bit by bit, masked as TFRecord stores it: a reference independent of the library's table-driven CRC.
uint32_t masked_crc32c_reference(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  crc = ~crc;
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

uint64_t little_endian(const std::string& bytes, size_t at, size_t size) {
  uint64_t value = 0;
  for (size_t i = 0; i < size; ++i)
    value |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  return value;
}

TEST(Telemetry, TensorBoardFilesAreWholeTFRecordsWithCastagnoliChecksums) {
  if (!gpuops::telemetry::tensorboard_available()) GTEST_SKIP() << "built without TensorBoard files";
  EXPECT_EQ(masked_crc32c_reference("123456789"), ((0xE3069283u >> 15) | (0xE3069283u << 17)) + 0xa282ead8u)
      << "the reference: CRC-32C's published check value";
  const std::string folder = temp_path("tensorboard");
  RecorderOptions options;
  options.log_every = 2;
  options.tensorboard_dir = folder;
  {
    MetricsRecorder recorder(options);
    for (int64_t step = 4; step <= 8; ++step) {  // a resumed run: a START event, then records at 4, 6, 8
      StepReport report;
      report.loss = at::rand({});
      recorder.step_done(step, report);
    }
  }
  std::vector<std::string> files;  // POSIX, not std::filesystem (src/state/posix_files.h says why)
  if (DIR* listing = ::opendir(folder.c_str())) {
    while (const dirent* entry = ::readdir(listing))
      if (entry->d_name[0] != '.') files.push_back(folder + "/" + entry->d_name);
    ::closedir(listing);
  }
  ASSERT_EQ(files.size(), 1u);
  EXPECT_NE(files[0].find("/events.out.tfevents."), std::string::npos);
  const std::string bytes = read_text(files[0]);
  size_t at = 0, records = 0;
  while (at + 12 <= bytes.size()) {
    const uint64_t length = little_endian(bytes, at, 8);
    ASSERT_EQ(little_endian(bytes, at + 8, 4), masked_crc32c_reference(bytes.substr(at, 8))) << "record " << records;
    ASSERT_LE(at + 16 + length, bytes.size());
    EXPECT_EQ(little_endian(bytes, at + 12 + length, 4), masked_crc32c_reference(bytes.substr(at + 12, length)));
    at += 16 + length;
    ++records;
  }
  EXPECT_EQ(at, bytes.size());  // nothing but whole records
  EXPECT_EQ(records, 5u);       // the file version, the START, three records (4, 6, 8)
  ::unlink(files[0].c_str());
  ::rmdir(folder.c_str());
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
// as Python does) goes on, and the endpoint serves the next scrape whole (its sends use MSG_NOSIGNAL).
TEST(Telemetry, ScrapersHangingUpLeaveTheEndpointServing) {
  ASSERT_TRUE(gpuops::telemetry::prometheus_available());
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
