#include "record_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace gpuops::telemetry::detail {
namespace {

std::string read_all(int fd) {
  std::string text;
  char buffer[1 << 16];
  off_t offset = 0;
  for (;;) {
    const ssize_t n = pread(fd, buffer, sizeof buffer, offset);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "telemetry: cannot read its file: ", std::strerror(errno));
    if (n == 0) return text;
    text.append(buffer, static_cast<size_t>(n));
    offset += n;
  }
}

// A figure as a CSV cell: empty where it was not reported.
std::string cell(double v) { return std::isfinite(v) ? fmt::format("{}", v) : ""; }

std::string csv_header(const Record& r) {
  std::string line = "step";
  for (const auto& [name, value] : r.figures) line += "," + name;
  for (size_t g = 0; g < r.lrs.size(); ++g) line += fmt::format(",lr_{}", g);
  return line + "\n";
}

std::string csv_line(const Record& r, int64_t lr_columns) {
  std::string line = std::to_string(r.step);
  for (const auto& [name, value] : r.figures) line += "," + cell(value);
  for (int64_t g = 0; g < lr_columns; ++g) line += "," + (g < static_cast<int64_t>(r.lrs.size()) ? cell(r.lrs[g]) : "");
  return line + "\n";
}

// The step of a record line, or -1 for a line that is not a record (the CSV header).
int64_t step_of(const std::string& line, RecordFormat format) {
  if (format == RecordFormat::JsonLines) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<int64_t>() : -1;
  }
  const std::string first = line.substr(0, line.find(','));
  return !first.empty() && first.find_first_not_of("0123456789") == std::string::npos ? std::stoll(first) : -1;
}

}  // namespace

RecordFile::RecordFile(std::string path, RecordFormat format) : path_(std::move(path)), format_(format) {
  fd_ = open(path_.c_str(), O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK_VALUE(fd_ >= 0, "telemetry: the file ", path_, " cannot be opened for appending: ",
                    std::strerror(errno), "; accepted: a writable path");
  std::string text = read_all(fd_);
  const size_t complete = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (complete < text.size()) {  // a partial last line: cut it off, so that no reader ever sees it
    TORCH_CHECK(ftruncate(fd_, static_cast<off_t>(complete)) == 0, "telemetry: cannot repair ", path_, ": ",
                std::strerror(errno));
    text.resize(complete);
  }
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (format_ == RecordFormat::Csv && line.rfind("step,", 0) == 0) {  // the header: how many lr columns
      std::string columns = "step";
      for (const auto& name : figure_names()) columns += "," + name;
      TORCH_CHECK_VALUE(line.substr(0, line.find(",lr_")) == columns, "telemetry: ", path_, " is a CSV with other "
                        "columns (another gpuops version wrote it): rows appended now would not match its header; "
                        "accepted: a CSV this version wrote, or a new file");
      lr_columns_ = 0;
      for (size_t at = line.find(",lr_"); at != std::string::npos; at = line.find(",lr_", at + 1)) ++lr_columns_;
      continue;
    }
    last_step_ = std::max(last_step_, step_of(line, format_));
  }
}

RecordFile::~RecordFile() {
  if (fd_ >= 0) close(fd_);
}

void RecordFile::append(const Record& record) {
  if (record.step <= last_step_) return;  // a resumed run reaches steps the file already holds
  std::string text;
  if (format_ == RecordFormat::JsonLines) {
    text = record.to_json() + "\n";
  } else {
    if (lr_columns_ < 0) {
      text = csv_header(record);
      lr_columns_ = static_cast<int64_t>(record.lrs.size());
    }
    text += csv_line(record, lr_columns_);
  }
  append_whole(fd_, text, path_, broken_);
  last_step_ = record.step;
}

void append_whole(int fd, const std::string& bytes, const std::string& path, bool& broken) {
  TORCH_CHECK(!broken, "telemetry: ", path, " ends with a partial record (a failed write could not be cut off): "
              "nothing more is written to it");
  struct stat before {};
  TORCH_CHECK(fstat(fd, &before) == 0, "telemetry: cannot write to ", path, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // cut off what this call wrote: the file ends with a whole record again
      const int error = n < 0 ? errno : ENOSPC;
      const bool restored = done == 0 || ftruncate(fd, before.st_size) == 0;
      broken = !restored;
      TORCH_CHECK(false, "telemetry: cannot write to ", path, ": ", std::strerror(error),
                  restored ? "" : " (the part written could not be cut off: the file ends with a partial record)");
    }
    done += static_cast<size_t>(n);
  }
  // No fsync: a completed write is in the page cache, which a killed process cannot lose; a power cut can cut
  // the last record, which the next open of a JSON Lines or CSV file cuts off. (fsync per record cost 2 ms a
  // step here while CI ran.)
}

}  // namespace gpuops::telemetry::detail
