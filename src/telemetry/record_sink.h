#pragma once
// What the recorder writes its records to (private to src/telemetry): JSON Lines and CSV files (record_file.h),
// TensorBoard event files (tensorboard_events.h).
#include <cstdint>
#include <string>

#include "gpuops/telemetry.h"

namespace gpuops::telemetry::detail {

class RecordSink {
 public:
  virtual ~RecordSink() = default;
  /// Writes the record (c10::Error when it cannot: the recorder warns and goes on).
  virtual void append(const Record& record) = 0;
  /// The last step the sink already held when it was opened (0: none, or a sink that does not tell).
  virtual int64_t last_step() const = 0;
};

/// Appends `bytes` to the file open as `fd` (O_APPEND) in as many writes as it takes. A write that fails (a full
/// disk, a file size limit) leaves the file as it was: what it had written is cut off again, so that the file
/// holds whole records only; c10::Error naming `path`. `broken`: true before the call refuses it (a file that
/// ends with a partial record gets nothing more); set when a failed write could not be cut off.
void append_whole(int fd, const std::string& bytes, const std::string& path, bool& broken);

}  // namespace gpuops::telemetry::detail
