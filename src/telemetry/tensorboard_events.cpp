// TensorBoard event files: one per recorder, appended record by record (the events' bytes:
// tensorboard_encoding.h).
#include "tensorboard_events.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "../common/file_checks.h"
#include "../state/posix_files.h"  // not std::filesystem: posix_files.h says why

#ifdef GPUOPS_WITH_TENSORBOARD
#include "tensorboard_encoding.h"
#endif

namespace gpuops::telemetry::detail {

using gpuops::detail::join_path;
using gpuops::detail::make_directories;
using gpuops::detail::parent_of;

namespace {

#ifdef GPUOPS_WITH_TENSORBOARD
double seconds_since_epoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// TensorBoard's own writers' name: "tfevents" marks an event file; the time, host, process and a counter keep
// two writers (two recorders of one process, one second apart or not) from sharing a file.
std::string event_file_name() {
  static std::atomic<int64_t> made{0};
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  return fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", static_cast<int64_t>(seconds_since_epoch()), host,
                     getpid(), made++);
}
#endif

}  // namespace

bool tensorboard_built() {
#ifdef GPUOPS_WITH_TENSORBOARD
  return true;
#else
  return false;
#endif
}

void check_tensorboard_folder(const std::string& folder) {
  TORCH_CHECK_VALUE(tensorboard_built(), "MetricsRecorder: tensorboard ", folder, " is not accepted: this gpuops "
                    "was built without TensorBoard files (they need protobuf-lite and Boost: Debian's "
                    "libprotobuf-dev, protobuf-compiler and libboost-dev, which scripts/system-packages installs)");
  TORCH_CHECK_VALUE(gpuops::detail::path_problem(folder).empty(), "MetricsRecorder: tensorboard '",
                    folder.substr(0, folder.find('\0')), "\\0...' holds a NUL byte; accepted: a path without one");
  // The nearest existing folder on the way must be writable: the rest is made.
  std::string existing = folder;
  struct stat info {};
  while (::stat(existing.c_str(), &info) != 0 && (errno == ENOENT || errno == ENOTDIR) &&
         parent_of(existing) != existing)
    existing = parent_of(existing);
  const bool is_folder = ::stat(existing.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
  TORCH_CHECK_VALUE(is_folder && access(existing.c_str(), W_OK | X_OK) == 0, "MetricsRecorder: tensorboard ",
                    folder, " cannot be a writable folder (", existing,
                    is_folder ? " is not writable" : " is not a folder", "); accepted: a folder that is, or can be "
                    "made as, a writable folder");
}

#ifdef GPUOPS_WITH_TENSORBOARD
TensorBoardEvents::TensorBoardEvents(const std::string& folder) {
  check_tensorboard_folder(folder);
  make_directories(folder);
  path_ = join_path(folder, event_file_name());
  fd_ = open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  TORCH_CHECK_VALUE(fd_ >= 0, "MetricsRecorder: tensorboard file ", path_, " cannot be made: ", std::strerror(errno),
                    "; accepted: a writable folder");
  try {
    append_whole(fd_, tensorboard::file_version_record(seconds_since_epoch()), path_, broken_);
  } catch (const c10::Error& e) {
    close(fd_);
    unlink(path_.c_str());
    TORCH_CHECK_VALUE(false, "MetricsRecorder: tensorboard file ", path_, " cannot be written: ",
                      e.what_without_backtrace());
  }
}

void TensorBoardEvents::append(const Record& record) {
  double wall_time = seconds_since_epoch();
  for (const auto& [name, value] : record.figures)
    if (name == "time" && std::isfinite(value)) wall_time = value;
  std::vector<tensorboard::Scalar> scalars;
  const auto add = [&scalars](std::string tag, double value) {
    if (std::isfinite(value)) scalars.push_back({std::move(tag), static_cast<float>(value)});  // else not reported
  };
  for (const auto& [name, value] : record.figures)
    if (name != "time") add("gpuops/" + name, value);  // the time is the event's wall time (float32 loses it)
  for (size_t group = 0; group < record.lrs.size(); ++group) add(fmt::format("gpuops/lr/{}", group), record.lrs[group]);
  std::string bytes;
  if (start_step_ < 0) start_step_ = record.first_step;  // the first record's, even if its write fails
  if (!run_started_ && start_step_ > 1)  // a resumed run: TensorBoard drops the steps it repeats
    bytes = tensorboard::run_start_record(wall_time, start_step_);
  bytes += tensorboard::scalars_record(wall_time, record.step, scalars);
  append_whole(fd_, bytes, path_, broken_);  // both events in one append: a failed one leaves neither
  run_started_ = true;
}

TensorBoardEvents::~TensorBoardEvents() {
  if (fd_ >= 0) close(fd_);
}
#else
TensorBoardEvents::TensorBoardEvents(const std::string& folder) { check_tensorboard_folder(folder); }
void TensorBoardEvents::append(const Record&) {}
TensorBoardEvents::~TensorBoardEvents() = default;
#endif

}  // namespace gpuops::telemetry::detail
