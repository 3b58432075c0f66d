#pragma once
// Training telemetry: the figures of each optimizer step, gathered without a host sync on the step path (device
// values are accumulated on their device; one device-to-host read per log interval) and written, one record per
// interval, to JSON Lines and CSV files, TensorBoard event files, a callback and a Prometheus endpoint.
// docs/telemetry.md.
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace gpuops::dist {
class Communicator;
}

namespace gpuops::telemetry {

struct RecorderOptions {
  int64_t log_every = 10;          ///< optimizer steps per record, >= 1
  std::string jsonl_path;          ///< JSON Lines file, appended (empty: none)
  std::string csv_path;            ///< CSV file, appended, its header written once (empty: none)
  int64_t rank = 0;                ///< this process's rank, 0 <= rank < world_size
  int64_t world_size = 1;
  bool every_rank_writes = false;  ///< false: rank 0 writes; true: each rank to "<path>.rank<r>"
  double flops_per_token = 0;      ///< training FLOPs per token (estimator::training_flops_per_token; 0: no TFLOPS)
  double peak_flops = 0;           ///< the GPU's peak FLOP/s for the run's dtype (0: no MFU)
  /// A Prometheus endpoint (GET /metrics, the latest record) on every rank: -1 none; 0 a free port (see
  /// MetricsRecorder::prometheus_port); else rank 0's port, rank r serving on prometheus_port + r.
  int64_t prometheus_port = -1;
  std::string prometheus_address = "127.0.0.1";  ///< the one address the endpoint binds
  std::string job = "gpuops";                    ///< the endpoint's job label (rank and world_size are labels too)
  /// A folder for TensorBoard event files (empty: none; made if missing; every_rank_writes: "<folder>/rank<r>"):
  /// each record's figures as scalars gpuops/<figure> at its step. A run whose first step is after 1 (resumed)
  /// has TensorBoard drop the earlier run's events from that step on.
  std::string tensorboard_dir;
  /// The GPU whose NVML figures (device_monitor.h: utilisation, memory used, temperature, power, SM clock,
  /// energy and energy per token) each record holds: its PCI bus id or NVML index; empty: none. Sampled every
  /// gpu_sample_s seconds (> 0, <= 3600) by a thread of its own; NaN figures where NVML is absent.
  std::string gpu;
  double gpu_sample_s = 1.0;
};

struct Record;
/// A user's sink: called with each record on the ranks that write (an exception it throws is a warning, but
/// CallbackStop, which goes through).
using RecordCallback = std::function<void(const Record&)>;

/// Thrown by a callback that stops the run rather than fails (Python's KeyboardInterrupt and SystemExit are
/// wrapped in it): the recorder lets it through, unchanged, to the caller of step_done/flush/close.
struct CallbackStop {
  std::exception_ptr original;  ///< what the callback threw
};

/// What one optimizer step hands over. The tensors are kept (not read) until the log interval ends.
struct StepReport {
  std::optional<at::Tensor> loss;           ///< the step's loss, one element, any device
  std::optional<at::Tensor> grad_norm;      ///< the global gradient norm (clip_grad_norm_'s result)
  std::optional<at::Tensor> loss_scale;     ///< the GradScaler's scale after the step
  std::optional<at::Tensor> skipped_steps;  ///< the GradScaler's running count of skipped (overflow) steps
  std::vector<double> lrs;                  ///< the learning rate of each parameter group
  int64_t tokens = 0;                       ///< tokens the step trained on (0: not reported)
  int64_t samples = 0;                      ///< samples the step trained on (0: not reported)
  std::optional<double> data_wait_s;        ///< seconds the step waited for its data (the loader), >= 0
};

/// Saves of training states since the process began: StateStore::commit reports each (the C++ and the Python
/// TrainingState, sharded or not), its seconds from begin() to the commit and the bytes of its files. A recorder
/// reports the saves made since its last record.
struct CheckpointSaves {
  int64_t count = 0;
  double seconds = 0;
  int64_t bytes = 0;
};
void note_checkpoint_saved(double seconds, int64_t bytes);
CheckpointSaves checkpoint_saves();

/// The figures of one log interval, in a fixed order (the CSV's columns), and the learning rates.
struct Record {
  int64_t step = 0;                                   ///< optimizer steps done at the interval's end
  int64_t first_step = 0;                             ///< the interval's first optimizer step
  std::vector<std::pair<std::string, double>> figures;  ///< NaN where a figure was not reported
  std::vector<double> lrs;
  std::string to_json() const;  ///< one line, no newline
};

/// True: every build of gpuops serves a Prometheus endpoint (kept from when it needed cpp-httplib).
bool prometheus_available();
/// True when this build of gpuops can write TensorBoard event files (it was built with protobuf-lite and Boost).
bool tensorboard_available();

/// Names of Record::figures, in order.
const std::vector<std::string>& figure_names();

class MetricsRecorder {
 public:
  /// Opens the sinks (ValueError naming the option for a bad value or a path that cannot be appended to). A file
  /// that already holds records is continued: a partial last line (a crash during a write) is cut off, and
  /// records of steps it already has are not written again (a run resumed from a checkpoint). With a
  /// communicator (copied), every record also holds figures over all ranks (two small all-reduces per record:
  /// every rank must record the same steps; with check_collectives, ranks that do not raise naming the call) and
  /// this rank's collective bytes per step.
  explicit MetricsRecorder(RecorderOptions options, RecordCallback callback = nullptr,
                           const dist::Communicator* communicator = nullptr);
  ~MetricsRecorder();
  MetricsRecorder(const MetricsRecorder&) = delete;
  MetricsRecorder& operator=(const MetricsRecorder&) = delete;

  /// Adds optimizer step `step` (>= 1, increasing). Device values are combined with device ops only; at every
  /// log_every-th step the interval's record is made (one device-to-host read) and written. A non-finite loss
  /// is counted, not an error.
  void step_done(int64_t step, const StepReport& report);
  /// The record of the steps since the last one, made and written now (none if there are none).
  std::optional<Record> flush();
  /// flush(), then the Prometheus endpoint stops serving (its port is free again); later steps are still recorded.
  std::optional<Record> close();
  /// Device-to-host reads so far: one per record with values on a GPU (CPU values are read where they are).
  int64_t host_reads() const;
  /// The last step a sink already held when it was opened (0: none).
  int64_t resumed_after() const;
  /// The port this rank's Prometheus endpoint serves on (-1: none).
  int64_t prometheus_port() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace gpuops::telemetry
