#include "record_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <algorithm>
#include <cstring>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../common/file_checks.h"
#include "../state/posix_files.h"

namespace gpuops::telemetry::detail {
namespace {

// How much of an existing file is read to continue it: its first line (the CSV header, or a record that tells
// the file is ours) and its last complete line (the step to resume after). A record line is well under this;
// a longer first or last line is not one of ours. A log of any size costs this much to open.
constexpr size_t kMaxLine = size_t{1} << 16;

// Up to `length` bytes at `offset` (fewer at the end of the file).
std::string read_at(int fd, off_t offset, size_t length, const std::string& path) {
  std::string text(length, '\0');
  size_t done = 0;
  while (done < length) {
    const ssize_t n = pread(fd, text.data() + done, length - done, offset + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "telemetry: cannot read ", path, ": ", std::strerror(errno));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  text.resize(done);
  return text;
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

// The start of a line gpuops wrote, cut before its end by a crash: JSON Lines records begin with {"step":
// (ordered keys), CSV lines with the header's "step," or a step number and its comma.
bool starts_like_ours(const std::string& line, RecordFormat format) {
  if (format == RecordFormat::JsonLines) return line.rfind("{\"step\":", 0) == 0 || std::string("{\"step\":").rfind(line, 0) == 0;
  if (line.rfind("step,", 0) == 0 || std::string("step,").rfind(line, 0) == 0) return true;
  const size_t digits = line.find_first_not_of("0123456789");
  return digits > 0 && (digits == std::string::npos || line[digits] == ',');
}

}  // namespace

RecordFile::RecordFile(std::string path, RecordFormat format) : path_(std::move(path)), format_(format) {
  const std::string problem = gpuops::detail::path_problem(path_);
  TORCH_CHECK_VALUE(problem.empty(), "telemetry: the path '", path_.substr(0, path_.find('\0')), "\\0...' ", problem,
                    "; accepted: a path without NUL bytes");
  const std::string folder = gpuops::detail::parent_of(path_);
  if (!folder.empty() && folder != path_) gpuops::detail::make_directories(folder);  // as tensorboard= makes its own
  // Not through a symbolic link, and without blocking on a FIFO: only a regular file (or a new one) is written.
  fd_ = open(path_.c_str(), O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  TORCH_CHECK_VALUE(fd_ >= 0, "telemetry: the file ", path_, " cannot be opened for appending: ",
                    errno == ELOOP ? "it is a symbolic link" : std::strerror(errno),
                    "; accepted: a writable regular file, or a new path");
  struct stat info {};
  if (fstat(fd_, &info) != 0 || !S_ISREG(info.st_mode)) {
    close(fd_);
    fd_ = -1;
    TORCH_CHECK_VALUE(false, "telemetry: ", path_, " is not a regular file (a FIFO, socket or device); accepted: a "
                      "writable regular file, or a new path");
  }
  try {
    resume(static_cast<size_t>(info.st_size));
  } catch (...) {
    close(fd_);
    fd_ = -1;
    throw;
  }
}

void RecordFile::resume(size_t size) {
  if (size == 0) return;
  const auto foreign = [&](const std::string& why) {
    TORCH_CHECK_VALUE(false, "telemetry: ", path_, " exists and is not a gpuops metrics file (", why, "); nothing "
                      "was written to it; accepted: a ", format_ == RecordFormat::Csv ? "CSV" : "JSON Lines",
                      " file gpuops wrote, or a new path");
  };
  // The first line: the CSV header, or a record.
  const std::string head = read_at(fd_, 0, std::min(size, kMaxLine), path_);
  const size_t head_end = head.find('\n');
  if (head_end == std::string::npos) {  // one unterminated line: ours only as a first record cut by a crash
    if (size >= kMaxLine || !starts_like_ours(head, format_)) foreign("its first line is not a record");
    TORCH_CHECK(ftruncate(fd_, 0) == 0, "telemetry: cannot repair ", path_, ": ", std::strerror(errno));
    return;
  }
  const std::string first = head.substr(0, head_end);
  if (format_ == RecordFormat::Csv) {
    std::string columns = "step";
    for (const auto& name : figure_names()) columns += "," + name;
    if (first.rfind("step,", 0) != 0) foreign("its first line is not gpuops' CSV header");
    TORCH_CHECK_VALUE(first.substr(0, first.find(",lr_")) == columns, "telemetry: ", path_, " is a CSV with other "
                      "columns (another gpuops version wrote it): rows appended now would not match its header; "
                      "accepted: a CSV this version wrote, or a new file");
    lr_columns_ = 0;
    for (size_t at = first.find(",lr_"); at != std::string::npos; at = first.find(",lr_", at + 1)) ++lr_columns_;
  } else if (step_of(first, format_) < 0) {
    foreign("its first line is not a record");
  }
  // The end: the last complete line, and what follows it (a record cut by a crash before its newline).
  const size_t tail_length = std::min(size, 2 * kMaxLine);
  const std::string tail = read_at(fd_, static_cast<off_t>(size - tail_length), tail_length, path_);
  const size_t end = tail.rfind('\n');  // of the last complete line
  const size_t partial = end == std::string::npos ? tail.size() : tail.size() - end - 1;
  if (end == std::string::npos || end == 0 || partial >= kMaxLine ||
      (partial > 0 && !starts_like_ours(tail.substr(end + 1), format_)))
    foreign("its last line is not a record");
  const size_t before = tail.rfind('\n', end - 1);
  const std::string last = before != std::string::npos ? tail.substr(before + 1, end - before - 1)
                           : tail_length == size       ? tail.substr(0, end)
                                                       : std::string();  // longer than any record
  const int64_t step = step_of(last, format_);
  const bool header_only = format_ == RecordFormat::Csv && last == first;
  if (step < 0 && !header_only) foreign("its last complete line is not a record");
  last_step_ = std::max<int64_t>(0, step);
  if (partial > 0) {  // a partial last record: cut off, so that no reader ever sees it
    TORCH_CHECK(ftruncate(fd_, static_cast<off_t>(size - partial)) == 0, "telemetry: cannot repair ", path_, ": ",
                std::strerror(errno));
  }
}

void RecordFile::roll_back(int64_t from_step) {
  struct stat info {};
  TORCH_CHECK(fstat(fd_, &info) == 0, "telemetry: cannot read ", path_, ": ", std::strerror(errno));
  const off_t size = info.st_size;
  if (size == 0) return;
  // Lines from the end, each read once: `buf` holds [buf_start, line_end), the lines not yet looked at.
  off_t line_end = size, buf_start = size;
  std::string buf;
  int64_t kept_step = 0;
  while (line_end > 0) {
    size_t newline = std::string::npos;  // the one before this line: where it starts
    while (true) {
      const size_t last = static_cast<size_t>(line_end - 1 - buf_start);  // this line's own newline
      newline = last == 0 || buf.empty() ? std::string::npos : buf.rfind('\n', last - 1);
      if (newline != std::string::npos || buf_start == 0 || line_end - buf_start > static_cast<off_t>(kMaxLine))
        break;
      const size_t more = static_cast<size_t>(std::min<off_t>(buf_start, static_cast<off_t>(kMaxLine)));
      buf_start -= static_cast<off_t>(more);
      buf = read_at(fd_, buf_start, more, path_) + buf;
    }
    const off_t start = newline == std::string::npos ? buf_start : buf_start + static_cast<off_t>(newline) + 1;
    if (newline == std::string::npos && buf_start > 0) break;  // a line longer than any record: not ours, kept
    const int64_t step = step_of(buf.substr(static_cast<size_t>(start - buf_start),
                                            static_cast<size_t>(line_end - 1 - start)), format_);
    if (step < from_step) {  // (the CSV header's is -1)
      kept_step = std::max<int64_t>(0, step);
      break;
    }
    line_end = start;
    buf.resize(static_cast<size_t>(start - buf_start));
  }
  if (line_end == size) return;
  TORCH_CHECK(ftruncate(fd_, line_end) == 0, "telemetry: cannot cut the abandoned run's records off ", path_, ": ",
              std::strerror(errno));
  last_step_ = kept_step;
}

RecordFile::~RecordFile() {
  if (fd_ >= 0) close(fd_);
}

void RecordFile::append(const Record& record) {
  // A run resumed from an earlier checkpoint than the file's last record replaces the abandoned run's records
  // from its first step on, as TensorBoard drops them (the SessionLog START of tensorboard_events.cpp).
  if (!appended_ && record.first_step > 1 && record.first_step <= last_step_) roll_back(record.first_step);
  appended_ = true;
  if (record.step <= last_step_) return;  // a step the file already holds (e.g. recorded twice in one run)
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
