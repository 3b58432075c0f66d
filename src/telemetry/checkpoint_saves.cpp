// The process-wide count of training-state saves (see CheckpointSaves in gpuops/telemetry.h): StateStore::commit
// adds each; recorders read the totals and report the difference since their last record.
#include <mutex>

#include "gpuops/telemetry.h"

namespace gpuops::telemetry {
namespace {

std::mutex mutex;
CheckpointSaves totals;

}  // namespace

void note_checkpoint_saved(double seconds, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  totals.count += 1;
  totals.seconds += seconds;
  totals.bytes += bytes;
}

CheckpointSaves checkpoint_saves() {
  std::lock_guard<std::mutex> lock(mutex);
  return totals;
}

}  // namespace gpuops::telemetry
