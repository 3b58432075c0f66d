#pragma once
// Preemption-safe training state for LibTorch C++, the twin of gpuops.TrainingState: atomic,
// checksummed states with a manifest, a LATEST pointer and keep-K, and a stop flag set by SIGTERM/SIGUSR1
// that every rank agrees on before saving.
//
// Files: the StateStore protocol (state_store.h), shared with the Python class: each save is a folder
// state-<step> holding `state.pt` (a torch::serialize archive) and its checksums, renamed into place complete;
// manifest.json and LATEST index them; keep-K removes older ones only after the new one is durable. A process
// killed at any moment leaves every state that was complete before.

#include <csignal>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>  // complete: the options hold an intrusive_ptr to one

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace gpuops {
namespace amp {
class GradScaler;
}

/// The objects a state holds; those left null are neither saved nor loaded.
struct TrainingObjects {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  amp::GradScaler* scaler = nullptr;
};

/// Where training stands, saved next to the objects.
struct TrainingProgress {
  int64_t step = 0;  ///< optimizer steps done (the next step's index), as every example and the docs use it
  int64_t epoch = 0;
  int64_t data_position = 0;  ///< e.g. the next batch index of the epoch
  std::map<std::string, c10::IValue> extras;  ///< anything else (tensors, numbers, strings)
};

/// What load() found: the progress and the file it came from. With several ranks the progress's data_position
/// and extras (and the RNG states restored) are this rank's own, as it saved them; `ranks` holds every saving
/// rank's (step and epoch are shared), to map data positions when the world size changed.
struct LoadedState : TrainingProgress {
  std::string path;
  std::vector<TrainingProgress> ranks;  ///< empty for a state saved by one process
};

struct TrainingStateOptions {
  int64_t keep = 3;                                  ///< states kept on disk, >= 1
  std::vector<int> signals = {SIGTERM, SIGUSR1};     ///< caught while the object lives: they set the stop flag
  /// With a process group (a c10d backend: ProcessGroupGloo, ProcessGroupNCCL, ...), should_stop() is agreed
  /// by every rank and only rank 0 writes; null: this process alone.
  c10::intrusive_ptr<c10d::Backend> process_group;
};

class TrainingState {
 public:
  /// Creates the folder if needed and installs the signal handlers (the previous ones come back on
  /// destruction). c10::ValueError for keep < 1 or a folder that cannot be created.
  explicit TrainingState(std::string directory, TrainingStateOptions options = {});
  ~TrainingState();
  TrainingState(const TrainingState&) = delete;
  TrainingState& operator=(const TrainingState&) = delete;

  /// Writes a complete state atomically (RNG states of CPU and every CUDA device included); returns its path
  /// (the state's folder). A failed save leaves nothing behind, and its error names the path.
  /// With a process group only rank 0 writes and every rank returns after it has (a barrier). With a sharded
  /// optimizer (ZeroOptimizer) every rank writes its shard into the same state (sharded_state.h) and every
  /// rank returns the path; a failure on any rank leaves nothing and raises on every rank. With several ranks
  /// the ranks must agree on the step, the folder, keep and the model's layout (names, shapes, dtypes), and
  /// each rank's data_position, extras and RNG states are saved as its own.
  std::string save(const TrainingProgress& progress, const TrainingObjects& objects);

  /// Loads the newest good state into the objects; std::nullopt when the folder holds none. A missing,
  /// truncated or corrupt state is skipped with a warning naming it, and the previous good state is used;
  /// when states exist but none can be used, c10::Error lists each one's problem. A good state that does
  /// not fit the objects (another model) raises, leaving the objects as they were.
  /// With a sharded optimizer (ZeroOptimizer) every rank loads its shard from the per-rank files (a collective:
  /// the ranks agree that all succeeded, or all put their objects back and raise); a state saved by another
  /// world size is resharded exactly when allow_reshard, refused otherwise. With several ranks each rank gets
  /// its own data_position, extras and RNG states back; a rank the saving job did not have gets rank 0's, with
  /// a warning.
  std::optional<LoadedState> load(const TrainingObjects& objects, bool restore_rng = true, bool allow_reshard = false);

  /// True once a caught signal (on any rank, with a process group: a collective every rank must call) or
  /// request_stop() asked the job to stop.
  bool should_stop();
  void request_stop() { stop_requested_ = true; }

  const std::string& directory() const { return directory_; }

 private:
  struct Handlers;

  std::string directory_;
  TrainingStateOptions options_;
  bool stop_requested_ = false;
  std::unique_ptr<Handlers> handlers_;
};

}  // namespace gpuops
