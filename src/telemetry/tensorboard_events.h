#pragma once
// TensorBoard event files for the recorder's records (private to src/telemetry): each record one event of
// scalars, in the TFRecord framing TensorBoard reads; docs/telemetry.md, "TensorBoard".
#include <cstdint>
#include <string>

#include "record_sink.h"

namespace gpuops::telemetry::detail {

/// True when this build writes TensorBoard files (it was built with protobuf-lite and Boost's CRC).
bool tensorboard_built();

/// ValueError naming `folder` unless it is, or can be made as, a writable folder (checked before the recorder
/// opens anything), or this build cannot write TensorBoard files.
void check_tensorboard_folder(const std::string& folder);

class TensorBoardEvents : public RecordSink {
 public:
  /// Makes `folder` (and its parents) and a new event file in it, named as TensorBoard's own writers name theirs
  /// (events.out.tfevents.<seconds>.<host>.<pid>.<n>), beginning with the file-version event; ValueError naming
  /// the folder when it cannot.
  explicit TensorBoardEvents(const std::string& folder);
  ~TensorBoardEvents() override;
  TensorBoardEvents(const TensorBoardEvents&) = delete;
  TensorBoardEvents& operator=(const TensorBoardEvents&) = delete;

  /// The record's figures as scalars gpuops/<figure> and gpuops/lr/<group> at its step, in one event written
  /// whole (its wall time is the record's "time"). Before the first record of a run that begins after step 1 (a
  /// run resumed from a checkpoint), a SessionLog START at its first step: TensorBoard drops the earlier run's
  /// events from that step on, so that no step is shown twice.
  void append(const Record& record) override;
  int64_t last_step() const override { return 0; }  // TensorBoard purges instead
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t start_step_ = -1;  // the run's first step, from the first record on (-1: none yet)
  bool run_started_ = false;  // a record was written (with the START, when one is due)
  bool broken_ = false;       // a failed write could not be cut off (append_whole)
};

}  // namespace gpuops::telemetry::detail
