#pragma once
// An append-only file of telemetry records (JSON Lines or CSV), continued across restarts (private to
// src/telemetry).
#include <cstdint>
#include <string>

#include "gpuops/telemetry.h"
#include "record_sink.h"

namespace gpuops::telemetry::detail {

enum class RecordFormat { JsonLines, Csv };

class RecordFile : public RecordSink {
 public:
  /// Opens `path` for appending (created if missing). An existing file is continued: a last line without its
  /// newline (a crash during a write) is cut off, and last_step() is the step of its last record.
  RecordFile(std::string path, RecordFormat format);
  ~RecordFile() override;
  RecordFile(const RecordFile&) = delete;
  RecordFile& operator=(const RecordFile&) = delete;

  /// Appends the record as one whole line (one write of the line), unless its step is not after
  /// last_step(); CSV writes its header before the first record of a new file.
  void append(const Record& record) override;
  int64_t last_step() const override { return last_step_; }

 private:
  std::string path_;
  RecordFormat format_;
  int fd_ = -1;
  int64_t last_step_ = 0;
  int64_t lr_columns_ = -1;  // CSV: learning-rate columns of the header (-1: no header yet)
  bool broken_ = false;      // a failed write could not be cut off (append_whole)
};

}  // namespace gpuops::telemetry::detail
