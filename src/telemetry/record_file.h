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
  /// Opens `path` for appending (created, with its folders, if missing). Only a regular file is written:
  /// symbolic links, FIFOs, sockets and devices are refused naming the path (c10::ValueError), and so is an
  /// existing file that is not one gpuops wrote (its first and last complete lines must be our records or CSV
  /// header), with nothing written to it. An existing file of ours is continued: a last line without its
  /// newline (a crash during a write) is cut off, and last_step() is the step of its last record. Only the
  /// first and last 64-128 KiB are read, whatever the file's size.
  RecordFile(std::string path, RecordFormat format);
  ~RecordFile() override;
  RecordFile(const RecordFile&) = delete;
  RecordFile& operator=(const RecordFile&) = delete;

  /// Appends the record as one whole line (one write of the line), unless its step is not after
  /// last_step(); CSV writes its header before the first record of a new file. The first record of a resumed
  /// run (its first step after 1 and not after last_step()) first cuts the records of steps from that first
  /// step on off the file: the abandoned run's, which TensorBoard drops too. Only those lines are read.
  void append(const Record& record) override;
  int64_t last_step() const override { return last_step_; }

 private:
  /// Checks that the existing file (`size` bytes) is ours, reads its last step, cuts a partial last record.
  void resume(size_t size);
  /// Cuts the records of steps >= from_step off the end of the file, reading it backwards line by line.
  void roll_back(int64_t from_step);
  std::string path_;
  RecordFormat format_;
  int fd_ = -1;
  int64_t last_step_ = 0;
  int64_t lr_columns_ = -1;  // CSV: learning-rate columns of the header (-1: no header yet)
  bool broken_ = false;      // a failed write could not be cut off (append_whole)
  bool appended_ = false;    // a record of this run came (the first one may roll the file back)
};

}  // namespace gpuops::telemetry::detail
