#pragma once
// The communicator (issue 13 part 1): the collectives a sharded optimizer needs, over any
// c10d::ProcessGroup (Gloo on CPU, NCCL or any other backend handed in from Python), each returning a
// waitable handle so that communication overlaps computation, each bounded by a timeout.
//
// Buffers are flat and in place: reduce_scatter takes the whole buffer and leaves the reduced shard of
// this rank in buffer[rank * S, (rank + 1) * S), S = numel / size(); all_gather takes this rank's shard at
// that same place and fills the whole buffer. Results are read after wait(): an average is divided there.
//
// Made two ways:
//  - Communicator::from_environment(): the launcher's variables (torchrun: MASTER_ADDR, MASTER_PORT, RANK,
//    WORLD_SIZE, LOCAL_RANK; else SLURM's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID with MASTER_ADDR
//    and MASTER_PORT exported by the job script), a TCPStore rendezvous, a Gloo process group (CPU tensors).
//  - Communicator(process_group): any group, e.g. a torch.distributed group from Python (gpuops.dist).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace gpuops::dist {

enum class ReduceOp { Sum, Average, Max, Min };

/// "sum", "avg", "max", "min".
const char* reduce_op_name(ReduceOp op);

struct CommunicatorOptions {
  /// Every collective (and the rendezvous of from_environment) fails after this long: a stalled peer
  /// makes the others raise rather than hang. Must be positive.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  /// from_environment only: how long the TCPStore rendezvous and the Gloo group's connection together wait
  /// for every rank to arrive (process start-up can take longer than a collective should); the Gloo group gets
  /// what the store left of it.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(300)};
  /// Before each reduce-scatter, all-gather and all-reduce, every rank checks that the others call the same
  /// collective with the same sizes and dtypes (one small all-gather): a mismatch raises c10::ValueError on every
  /// rank, naming it, where Gloo would abort the process and NCCL hang. gpuops' sharded optimizer turns it off
  /// on its own copy (unchecked()): its layout is agreed when it is built, and its step spares the collective.
  bool check_collectives = true;
};

/// The longest timeout accepted (a year): longer ones overflow c10d's deadlines.
constexpr std::chrono::milliseconds kMaxTimeout{int64_t{365} * 24 * 3600 * 1000};

/// The launcher's variables, as from_environment reads them (exposed for tests and diagnostics).
struct LaunchEnvironment {
  std::string launcher;      ///< "torchrun" (RANK was set) or "slurm" (SLURM_PROCID was set)
  std::string master_addr;
  int master_port = 0;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
};

/// Reads and checks the launcher's variables; c10::ValueError naming the variable when one is missing or
/// out of range (RANK >= WORLD_SIZE, a port outside [1, 65535], ...). Starts nothing.
LaunchEnvironment read_launch_environment();

/// A collective in flight. wait() blocks until it completes (at most the communicator's timeout) and
/// finishes it (an average's division); it throws c10::DistBackendError naming the collective, this rank and
/// what the backend reported (the lost peer's address when Gloo sees a closed connection).
class Work {
 public:
  Work() = default;
  Work(Work&&) = default;
  Work& operator=(Work&&) = default;
  Work(const Work&) = delete;  // one owner: the average's division runs once
  Work& operator=(const Work&) = delete;
  /// Blocks until done; a second call returns at once. Throws as described above.
  void wait();
  /// True when the communication has finished (successfully or not): wait() then does not block.
  bool is_completed() const;
  /// "reduce_scatter(sum)", "all_gather", ...
  const std::string& name() const { return name_; }

 private:
  friend class Communicator;
  c10::intrusive_ptr<c10d::Work> work_;
  std::string name_;
  std::string where_;  ///< "rank r of n"
  std::chrono::milliseconds timeout_{0};
  std::function<void()> finish_;  ///< run once after success (divide for an average)
  bool done_ = false;
};

/// What one kind of collective moved through a communicator since the last reset_traffic().
struct TrafficCount {
  int64_t calls = 0;
  int64_t payload_bytes = 0;  ///< the whole buffers: reduce-scatter's input, all-gather's output, all-reduce's
  /// Bytes this rank sends in the bandwidth-optimal ring algorithm: (N-1)/N x payload for reduce-scatter and
  /// all-gather, 2(N-1)/N x payload for all-reduce. What the algorithm needs, not what a backend's
  /// implementation happens to send (Gloo's CPU collectives are not all rings).
  int64_t ring_sent_bytes = 0;
};

/// The traffic of a communicator (and of its copies, which share it), per kind of collective.
struct Traffic {
  TrafficCount reduce_scatter, all_gather, all_reduce;
  int64_t ring_sent_bytes() const {
    return reduce_scatter.ring_sent_bytes + all_gather.ring_sent_bytes + all_reduce.ring_sent_bytes;
  }
};

class Communicator {
 public:
  /// Over an existing group (every tensor's device type must have a backend in it).
  explicit Communicator(c10::intrusive_ptr<c10d::ProcessGroup> process_group, CommunicatorOptions options = {});

  /// Over one c10d backend (a ProcessGroupGloo serving CPU tensors, a ProcessGroupNCCL serving CUDA ones), as
  /// TrainingStateOptions::process_group holds it.
  static Communicator from_backend(const c10::intrusive_ptr<c10d::Backend>& backend, CommunicatorOptions options = {});

  /// From the launcher's environment (see read_launch_environment): TCPStore on MASTER_ADDR:MASTER_PORT
  /// (rank 0 serves it), then a Gloo group for CPU tensors. The Gloo device binds to MASTER_ADDR when it is a
  /// loopback address, to GLOO_SOCKET_IFNAME's interface when set, else to this host's name (c10d's default).
  /// NCCL is not built here yet: hand a torch.distributed NCCL group in from Python for CUDA tensors.
  static Communicator from_environment(CommunicatorOptions options = {});

  /// A copy without check_collectives (it shares the group and the traffic counts).
  Communicator unchecked() const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return group_; }

  /// Where small control messages (agreements, dist::Agreement) travel: the CPU when the group serves CPU
  /// tensors (Gloo), else the current CUDA device (NCCL).
  at::Device control_device() const;

  /// This rank's shard of a flat buffer: buffer[rank * S, (rank + 1) * S), a view.
  at::Tensor shard(const at::Tensor& buffer) const;

  /// Reduces the whole `buffer` over ranks (Sum or Average) into this rank's shard of it, in place. The
  /// other shards' contents are unspecified afterwards. numel must be divisible by size().
  Work reduce_scatter(const at::Tensor& buffer, ReduceOp op = ReduceOp::Sum);
  /// Out of place: `output` (numel = input.numel() / size(), same dtype and device) gets this rank's shard.
  Work reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op);

  /// Every rank's shard of `buffer` (at its place) into the whole buffer of every rank, in place.
  Work all_gather(const at::Tensor& buffer);
  /// Out of place: the shards `input` of all ranks concatenated into `output` (numel = size() * input.numel()).
  Work all_gather(const at::Tensor& input, const at::Tensor& output);

  /// `buffer` reduced over ranks, in place: Sum, Average (floating dtypes), Max or Min.
  Work all_reduce(const at::Tensor& buffer, ReduceOp op = ReduceOp::Sum);

  /// Completes when every rank has reached it.
  Work barrier();

  /// What the collectives launched through this communicator (or a copy of it) moved, counted at launch.
  Traffic traffic() const { return *traffic_; }
  void reset_traffic() { *traffic_ = Traffic{}; }

 private:
  Work launch(std::string name, c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish = {}) const;
  void check_tensor(const char* op, const char* arg, const at::Tensor& t) const;
  void check_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) const;
  void check_all_gather(const at::Tensor& input, const at::Tensor& output) const;
  /// Runs `checks` (this rank's checks of its arguments); with check_collectives, every rank's outcome and call
  /// (collective, element count, dtype, reduce op) are compared in one small all-gather, so that a rank whose
  /// arguments are refused, or a different call, raises on every rank. Without it, `checks` alone.
  void agree_on_call(const char* op, const at::Tensor& t, ReduceOp reduce, const std::function<void()>& checks) const;
  Work launch_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op);
  Work launch_all_gather(const at::Tensor& input, const at::Tensor& output);
  void count(TrafficCount& count, const at::Tensor& payload, int64_t ring_factor) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  CommunicatorOptions options_;
  int rank_ = 0;
  int size_ = 1;
  std::shared_ptr<Traffic> traffic_ = std::make_shared<Traffic>();
};

}  // namespace gpuops::dist
