#pragma once
// gpuops::optim::ZeroOptimizer<Base> (issue 13): ZeRO stages 1 and 2 over one of our fused optimizers (AdamW,
// Adam, SGD) and a Communicator. The parameters are cut into buckets (ZeroOptions::bucket_bytes, in reverse
// order), each a FlatParams buffer padded to a multiple of the world size; every rank owns the contiguous
// shard [rank * S, (rank + 1) * S) of each bucket and keeps the optimizer state of that shard only. The
// optimizer underneath (Base itself: ZeroOptimizer<AdamW> is an AdamW) steps one fp32 "shard parameter" per
// bucket: for a float32 bucket a leaf aliasing the shard of the flat parameters; for a float16/bfloat16 one
// the fp32 master copy of the shard, rounded (to nearest even) into the 16-bit parameters after the step. Its
// .grad is the reduced fp32 gradient shard. The step is Base's own fused step, on 1/N of the elements; the
// engine of everything else is ZeroShards.
//
// One step: (1) reduce-scatter every bucket's gradient (average over ranks), buckets in a fixed order: once
// per step after the accumulation window, or (reduce_in_backward) from autograd hooks while each backward
// runs. 16-bit gradients are reduced in fp32: chunks of kReduceChunk elements per rank converted on the fly,
// so the sum never rounds to 16 bits. (2) With a GradScaler: one all-reduce of the overflow flag (max) and,
// with clip_grad_norm_, one of the squared norm (sum, float64). (3) Base's fused step on the shards (scale and
// flag on the device, as a GradScaler hands them to every fused optimizer). (4) All-gather every bucket.
// Traffic per step: reduce-scatter + all-gather = one all-reduce of the parameters (per micro-batch for the
// reduce-scatter with reduce_in_backward), plus two one-element all-reduces.
//
// Stage 2 keeps only its gradient shards after the reduction (the flat gradients are freed: at the step, or
// bucket by bucket during backward with reduce_in_backward). Stage 1 float32 reducing at the step works in
// place: afterwards the parameters' .grad hold the average over ranks in this rank's shard only, elsewhere
// unspecified. Results do not depend on timing: the collectives run in a fixed order and are waited in order.
//
// Checkpoints (zero_checkpoint.cpp): every rank writes its shard and the layout (parameter offsets and sizes,
// world size, padding) to its own file; a job of any world size loads them, each rank reading only the files
// that overlap its new shard (online resharding, exact). consolidate_state() gathers torch's per-parameter
// optimizer state on one rank's host memory, chunk by chunk, so no device ever holds the whole state.
//
// 8-bit moments (issue 32; StateBlocks): the parameters that keep them get buffers laid out in whole 256-element
// blocks, so that a parameter's blocks are the unsharded optimizer's. Offload (issue 33; ZeroOptions::offload,
// zero_offload.cpp): the shard parameters and the optimizer state in host memory, stepped there bucket by bucket.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <torch/optim/optimizer.h>

#include "gpuops/agreement.h"
#include "gpuops/communicator.h"
#include "gpuops/flat_params.h"
#include "gpuops/optimizers.h"

namespace torch::autograd {
struct Node;  // a parameter's gradient accumulator (the reduce_in_backward hooks)
}

namespace gpuops::optim {

/// How a ZeroOptimizer shards and when it reduces.
struct ZeroOptions {
  int stage = 1;  ///< 1: optimizer state sharded; 2: optimizer state and gradients sharded
  /// false: the gradients accumulate locally over an accumulation window and are reduce-scattered once, at
  /// the step. true: each bucket is reduce-scattered from autograd hooks as soon as backward has produced all
  /// of its gradients (overlapping the rest of the backward), in every backward pass (micro-batch); the
  /// reduced shards are summed into fp32 gradient shards. Stage 2 then never holds the whole gradient (a
  /// bucket's flat gradient lives from its first gradient to its reduction); the traffic is one
  /// reduce-scatter per micro-batch. Stage 1 keeps its flat gradients allocated (zeroed after each reduction).
  bool reduce_in_backward = false;
  /// The parameters are cut, in reverse order (the order backward produces their gradients), into buckets
  /// of at most this many bytes (a larger parameter gets one of its own), each of one dtype and device; every
  /// bucket is a flat buffer padded to a multiple of the world size, each rank owning one contiguous shard of
  /// it. Checkpoints record the buckets: load them with the same bucket_bytes. >= 1.
  int64_t bucket_bytes = int64_t{25} << 20;
  /// The parameters' names (e.g. from named_parameters()), in the order of the parameters; empty: unnamed.
  /// Checkpoints record them with the shapes, so that loading into another model names the parameter that
  /// differs.
  std::vector<std::string> param_names;
  /// After the step the all-gathers of the parameters are launched, the buckets the forward reads first
  /// first, and not waited: the next forward overlaps them (Megatron's overlap_param_gather). Until waited the
  /// parameters hold their values from before the step: call wait_for_parameters(params) before a layer reads
  /// its parameters (Python's ZeroOptimizer does it from module forward pre-hooks), or wait_for_parameters()
  /// for all. Everything else of the optimizer (zero_grad, the reductions, the step, checkpoints,
  /// TrainingState) waits for all first.
  bool overlap_param_gather = false;

  // ------------------------------------------------------------------ stage 3 (zero_units.cpp)
  /// Stage 3: the unit of every parameter (params[i] belongs to unit units[i], units numbered 0 .. U-1 in the
  /// order a forward first runs them: the rest of the model, then each block). Each unit's parameters of one
  /// dtype form one flat buffer (bucket_bytes does not apply); a unit's full parameters exist only while it
  /// runs (gather_unit / release_unit, called around its forward and backward: Python's module hooks, C++'s
  /// ShardedSequential). Empty: one unit holding every parameter.
  std::vector<int64_t> units;
  /// Stage 3: gathers launched ahead of the unit that runs, in the order of the last forward (backward: its
  /// reverse). 0: none. [0, 64].
  int64_t prefetch = 1;
  /// Stage 3: a unit's full parameters are freed after its forward and gathered again for its backward
  /// (FSDP2's reshard_after_forward=True); false keeps them from its forward until its backward is done (less
  /// traffic, more memory). A forward without autograd (torch::NoGradGuard, evaluation) always frees them.
  bool reshard_after_forward = true;
  /// Stage 3: where the shards and the gathered units live, when not the parameters' device: a model built on
  /// the CPU (host memory holds it once) trains on a GPU that could not hold all of its parameters. The model is
  /// flattened one unit at a time on its own device, each unit's shard copied to `device`; the parameters
  /// become placeholders there (move the model's buffers with module.to(device) afterwards). Unset: the
  /// parameters' device.
  std::optional<c10::Device> device;
  /// Stage 3: before each unit's gather the ranks compare which unit they gather and what for (a forward with
  /// or without autograd, a backward, a read of the full parameters): one all-gather of two integers on the
  /// communicator's control device, read on the host. Ranks that run their units in different orders
  /// (LayerDrop with a seed per rank, a layer skipped or an extra forward on one rank) then raise on every
  /// rank naming each rank's unit, before the mismatched gather that Gloo answers by aborting the process
  /// (NCCL: a hang until the timeout). false skips the check: one small collective's latency and one host
  /// synchronisation fewer per unit gather (0.9 ms each over Gloo on a 2-vCPU machine: docs/benchmarks.md; a
  /// CUDA group also waits there for the gathers queued before it).
  bool check_unit_order = true;

  // ------------------------------------------------------------------ offload (issue 33)
  /// Where each rank's fp32 shard parameters (masters) and optimizer state live. Device: beside the
  /// parameters. Cpu: in host memory (pinned when the parameters are on a GPU); the device keeps the parameters
  /// and the flat gradients. Each bucket's reduced gradient shard is copied to the host when its reduction
  /// ends (at the step, or with reduce_in_backward during each backward, the micro-batches of an accumulation
  /// window summed on the host), stepped there by the optimizer's CPU kernels (bucket by bucket), and its
  /// updated values copied back into the parameters' shard before the all-gather. Stages 1-3; stage 3's device
  /// keeps each unit's shard of the parameters (what the units gather: 16-bit, or fp32 for float32 parameters)
  /// and, while a unit runs, its full parameters and gradients.
  enum class Offload { Device, Cpu };
  Offload offload = Offload::Device;
};

/// One entry of an offloaded step's timeline (ZeroShards::offload_timeline): what ran for which bucket, from
/// when to when (seconds on a steady clock since the window began: zero_grad(), or the reduction at the step).
struct OffloadEvent {
  std::string what;  ///< "gradient to host", "step", "parameters to device"
  size_t bucket = 0;
  double begin_s = 0;
  double end_s = 0;
};

/// How a ZeroOptimizer lays out buffers whose optimizer state is quantised per block (8-bit moments,
/// fused_adam8.h): parameters of `min_numel` elements or more go into buffers of their own (reduced before
/// the others' buffers, which then hold the small parameters of every layer; stage 3: a second buffer per
/// unit and dtype), each parameter starting at a multiple of `block`
/// elements and every shard a whole number of blocks. A parameter's blocks are then its own, as in the
/// unsharded optimizer (the step gives its bits; the consolidated state is cut out, not re-quantised), and
/// resharding copies whole blocks. block 0: no such buffers.
struct StateBlocks {
  int64_t block = 0;
  int64_t min_numel = 0;
};

/// An optimizer's state tensors by name ("step", "exp_avg", "momentum_buffer", "master_param", ...), the names
/// torch's state_dict uses.
using NamedTensors = std::map<std::string, at::Tensor>;

/// The sharding engine: flat buffers, shards, masters, the collectives of a step, checkpoint layouts. Used by
/// ZeroOptimizer<Base>; not an optimizer itself.
class ZeroShards {
 public:
  /// Elements per rank converted to fp32 at once when a 16-bit gradient is reduced (16 MiB per rank).
  static constexpr int64_t kReduceChunk = int64_t{1} << 22;

  /// Collective: every rank checks its arguments, then one agreement (agreement.h; `agreement` may hold the
  /// caller's own checks and fields: the optimizer's options). c10::ValueError on every rank, with the
  /// parameters unchanged, when any rank's check failed (a stage other than 1 or 2, a dtype other than
  /// float32/float16/bfloat16, a parameter without elements, a name with a line break, what FlatParams
  /// refuses) or the ranks differ in the parameters' count, shapes, dtypes or initial values, their names, or
  /// the options. With reduce_in_backward, a hook on every parameter's gradient accumulator (removed by the
  /// destructor): the object must not move, hence no copy or move.
  ///
  /// `state_bytes_per_element`: the optimizer state's bytes per parameter element, for offload's up-front
  /// check of the host memory (c10::ValueError naming what it needs and what is left).
  ZeroShards(const std::vector<at::Tensor>& params, dist::Communicator communicator, ZeroOptions options,
             dist::Agreement agreement = dist::Agreement("ZeroOptimizer"), StateBlocks blocks = {},
             double state_bytes_per_element = 0);
  ~ZeroShards();
  ZeroShards(const ZeroShards&) = delete;
  ZeroShards& operator=(const ZeroShards&) = delete;

  int stage() const { return options_.stage; }
  /// This optimizer's id, the same on every rank (rank 0's choice): its shard files carry it with a save count.
  const std::string& id() const { return id_; }
  /// A key naming this object while it lives, never reused: what an autograd node that may outlive the
  /// optimizer holds instead of a pointer (ShardedSequential's), so that a backward run after the optimizer
  /// was destroyed raises instead of reading freed memory.
  int64_t live_key() const { return live_key_; }
  /// The object with that key, or nullptr once it is destroyed.
  static ZeroShards* find_live(int64_t key);
  const ZeroOptions& options() const { return options_; }
  const StateBlocks& blocks() const { return blocks_; }
  /// Buffer k is laid out in whole state blocks (StateBlocks).
  bool blocked(size_t k) const { return blocked_[k]; }
  /// ZeroOptions::offload is Cpu: the shard parameters and their gradients live in host memory.
  bool offloaded() const { return options_.offload == ZeroOptions::Offload::Cpu; }
  /// Offload: the last step's timeline (the gradient copies, the steps and the parameter copies per bucket).
  const std::vector<OffloadEvent>& offload_timeline() const { return timeline_; }
  /// Offload: before bucket k's step, its gradient is on the host (waits for its copy).
  void wait_for_host_gradient(size_t k);
  /// Offload: after bucket k's step, its updated values are copied into the parameters' shard (asynchronous
  /// on a GPU; after_step waits before the all-gather).
  void send_shard(size_t k);
  /// Offload: records one timeline entry that began at `begin_s` (seconds_since_reduction()) and ends now.
  void record(const std::string& what, size_t k, double begin_s);
  double seconds_since_reduction() const;
  const dist::Communicator& communicator() const { return comm_; }
  dist::Communicator& communicator() { return comm_; }
  /// The flat buffers ("buckets"), in the order they are reduced.
  size_t bucket_count() const { return flats_.size(); }
  const FlatParams::Bucket& bucket(size_t k) const { return flats_[k]->buckets()[0]; }
  /// One fp32 leaf per flat buffer (see the top of this file); its .grad is the reduced gradient shard.
  const std::vector<at::Tensor>& shard_params() const { return shards_; }
  /// The shape of slot `slot` of bucket k's parameter (stage 3: its full shape, also while it is a placeholder).
  at::IntArrayRef param_sizes(size_t k, size_t slot) const;
  /// Number of parameters given (the consolidated state's length).
  size_t param_count() const { return slot_of_param_.size(); }
  /// The buffer holding params[i].
  size_t bucket_of_param(size_t i) const { return slot_of_param_.at(i).first; }

  /// set_to_none: the parameters count as without a gradient until a backward reaches them (torch's
  /// zero_grad(set_to_none=True)); false: those that had one keep it (zeros), and are stepped.
  void zero_grad(bool set_to_none = true);
  /// Reduce-scatters the gradients, once per step (a second call before the step does nothing; with
  /// reduce_in_backward the backward passes have done it). First agrees which parameters have a gradient
  /// (one all-reduce of a byte per parameter, read on the host; reduce_in_backward: at the end of each backward
  /// pass instead, so that the step communicates only its all-gathers). Collective.
  void reduce_gradients();

  // ------------------------------------------------------------------ parameters without a gradient
  /// torch's rule: a parameter without a gradient is not stepped (its state untouched). A parameter has one
  /// when a backward reached it since zero_grad() (or its .grad was written by hand) on some rank; on the
  /// other ranks its gradient counts as zero in the mean, as in DDP. Each parameter keeps its own step counter
  /// (the state's "step" holds one per parameter of the flat buffer).
  struct StepRun {
    int64_t offset = 0;  ///< in this rank's shard
    int64_t numel = 0;
    size_t slot = 0;  ///< its first parameter: whose counter it steps on
  };
  /// The runs of this rank's shard of buffer k to step now: consecutive parameters with a gradient whose
  /// counters are known equal (the whole shard when every parameter always had one).
  std::vector<StepRun> step_runs(size_t k) const;
  /// After the step: `counters` (buffer k's "step", one per parameter) advance where a parameter was
  /// stepped, unless found_inf (non-zero: the step was skipped).
  void advance_counters(size_t k, const at::Tensor& counters, const std::optional<at::Tensor>& found_inf);
  /// After a load: which of buffer k's counters are equal, from their values (one host read).
  void group_counters(size_t k, const at::Tensor& counters);
  /// The overflow flag, max over ranks. Like the two below, one small all-gather whose entries also say what
  /// each rank combines (host-read), so ranks combining different things (one clips while another's scaler
  /// checks for overflow, or one refused the step) raise together naming both instead of mixing the values.
  at::Tensor global_found_inf(const at::Tensor& found_inf);
  at::Tensor global_grad_norm(const at::Tensor& norm);
  /// The mean over ranks of a gradient divisor: after the average over ranks, gradients summed over each
  /// rank's samples divided by it are the mean over every rank's samples.
  at::Tensor global_divisor(const at::Tensor& divisor);
  /// This rank will not step (Python: a GradScaler other than ours handed over its scale): it takes part in
  /// what the others' step does first (the reduction, then the overflow flag's combine) so that they raise
  /// naming the cause instead of waiting for the timeout. Returns; the caller raises its own error.
  void refuse_step_with_foreign_scaler();
  /// Before the fused step: a 16-bit master follows its parameters where something else wrote them since the
  /// last step (a model load, an EMA swap) and the master no longer rounds to them. Warns (check_gradients).
  void before_step();
  /// Warns, once per optimizer and kind, when the model's gradients went through something ZeroOptimizer does
  /// not see: written in place after backward through the gradient tensors themselves (Python's
  /// torch.nn.utils.clip_grad_norm_ on the model's parameters clips each rank by its own norm before the
  /// reduction, or is lost after it) or reduced by another C++ reducer's hook (DistributedDataParallel's: every
  /// gradient reduced twice). reduce_gradients and before_step call it. Not seen: writes through .data(),
  /// which has a version counter of its own, as LibTorch's torch::nn::utils::clip_grad_norm_ makes them
  /// (grad().data().mul_()): clip with the optimizer's or a GradScaler's clip_grad_norm_ in C++.
  void check_gradients(bool reduced) const;
  /// After the fused step: masters rounded into the 16-bit shards, every buffer all-gathered (waited, unless
  /// overlap_param_gather). Collective.
  void after_step();
  /// overlap_param_gather: waits for the all-gathers of the buckets holding `params` (what a layer is about
  /// to read); the others go on. Returns at once when nothing is pending. c10::ValueError for a tensor that
  /// is not one of the optimizer's parameters.
  void wait_for_parameters(const std::vector<at::Tensor>& params) const;
  /// ... of every bucket, the first parameters' first.
  void wait_for_parameters() const;

  // ------------------------------------------------------------------ stage 3 units (zero_units.cpp)
  /// Why a unit is gathered: part of what the ranks compare (check_unit_order).
  enum class GatherFor : int64_t { Forward = 1, ForwardNoGrad = 2, Backward = 3, Read = 4 };
  size_t unit_count() const { return unit_buckets_.size(); }
  /// Before unit u's forward: its parameters gathered (waited) and the next `prefetch` units of the last
  /// forward's order launched. Collective (every rank runs the same units in the same order). Inside a backward
  /// (a checkpointed unit recomputed) it only makes sure u is gathered.
  void unit_pre_forward(size_t u);
  /// After unit u's forward: frees its full parameters (reshard_after_forward, or no autograd); inside a
  /// backward (recomputation) it keeps them for the backward that follows.
  void unit_post_forward(size_t u);
  /// Before unit u's backward (the gradient of one of its outputs arrived): u gathered, the previous units'
  /// gathers launched. Ends with the backward pass: every unit is freed and (reduce_in_backward) every
  /// gradient reduced when the backward finishes.
  void unit_pre_backward(size_t u);
  /// The parameter tensors of unit u (ShardedSequential checks its layers against them).
  std::vector<at::Tensor> unit_tensors(size_t u) const;
  /// Bytes of full (gathered) parameter buffers held now: the units in flight.
  int64_t gathered_bytes() const;
  /// Stage 3: the full values of every parameter, in the order given, on rank `to`'s host memory, gathered
  /// unit by unit (no device ever holds more than one unit); other ranks get an empty vector. Collective.
  std::vector<at::Tensor> full_parameters(int to);
  /// Stage 3: sets every parameter's shard from full values (parameter order, any device: a model's
  /// state_dict); masters follow. Floating values of another dtype are converted, as torch's load_state_dict
  /// copies them. Collective: every rank checks its values, then the ranks agree on a fingerprint of them.
  /// c10::ValueError on every rank, nothing changed on any, for a count or shape that differs, a value that is
  /// not floating, or values that differ between ranks (a dict loaded with other values on some rank). A call
  /// on some ranks only waits for the others until the communicator's timeout and raises there.
  void load_full_parameters(const std::vector<at::Tensor>& values);

  int64_t gradient_bytes() const;  ///< flat gradients while allocated, plus the separate fp32 gradient shards
  int64_t master_bytes() const;    ///< fp32 master shards of 16-bit buffers

  // ------------------------------------------------------------------ checkpoints
  /// Writes this rank's file: format, `kind` (the optimizer's name), world size, rank, stage, the options
  /// archive, and per buffer its dtype, padded length, layout (offsets and sizes of its parameters) and
  /// `states[k]` (the state of shard parameter k, plus its master for a 16-bit buffer). Written to a
  /// temporary name and renamed into place.
  void save_shard(const std::string& path, const std::string& kind, const std::vector<NamedTensors>& states,
                  const torch::optim::OptimizerOptions& options) const;
  /// The same into an archive (torch::save, TrainingState's in-memory backup).
  void write_shard(torch::serialize::OutputArchive& archive, const std::string& kind,
                   const std::vector<NamedTensors>& states, const torch::optim::OptimizerOptions& options) const;

  /// What read_shards found: the state of each of this rank's shard parameters, the saved options, and which
  /// save the files come from ("<optimizer id>:<steps>", "unknown" for files of gpuops before the ids).
  struct ReadShards {
    std::vector<NamedTensors> states;
    torch::serialize::InputArchive options;
    int saved_world_size = 0;
    std::string checkpoint = "unknown";
    int64_t steps = 0;
  };
  /// Reads the files written by save_shard of every rank of the saving job (`files[r]`: rank r's), opening
  /// only those that overlap this rank's shard, and cuts this rank's shard of every element-wise state tensor
  /// out of them (exact, any world size when allow_reshard). Changes nothing. c10::ValueError for another
  /// optimizer kind, other parameters (layout), a file that is not a shard of that job, or another world size
  /// without allow_reshard.
  ReadShards read_shards(const std::vector<std::string>& files, const std::string& kind, bool allow_reshard) const;
  /// The same from this rank's archive of a job of this world size (write_shard's).
  ReadShards read_own(torch::serialize::InputArchive& archive, const std::string& kind) const;

  /// The per-parameter state (in the order the parameters were given) of shard states `states`, gathered on
  /// rank `to`'s host memory chunk by chunk; other ranks get an empty vector. Collective.
  std::vector<NamedTensors> consolidate(const std::vector<NamedTensors>& states, int to);
  /// This rank's shard states from a full per-parameter state (what consolidate returns, or a torch
  /// optimizer's state_dict()["state"] in parameter order). Changes nothing.
  std::vector<NamedTensors> shard_states_of(const std::vector<NamedTensors>& per_param) const;

  /// Takes the "master_param" entries out of shard states, each checked against its buffer (an fp32 copy of
  /// the shard's length), and returns them per buffer (undefined where there is none). Changes nothing.
  std::vector<at::Tensor> take_masters(std::vector<NamedTensors>& states) const;
  /// Makes `masters` (take_masters') the masters of the 16-bit buffers, those missing made again from the
  /// parameters; shard files saved from now on carry `id` and count steps from `steps`. Cannot fail on checked
  /// input: the last part of an all-or-nothing load.
  void install_loaded(const std::vector<at::Tensor>& masters, std::string id, int64_t steps);
  /// Steps taken (after_step calls), or the loaded count: with id(), what a shard file's save is known by.
  int64_t steps() const { return steps_; }
  /// The index k of a shard parameter (shard_params()[k]); c10::ValueError for another tensor.
  size_t shard_index(const at::Tensor& shard) const;
  /// The shard states with each 16-bit buffer's master added as "master_param".
  std::vector<NamedTensors> with_masters(std::vector<NamedTensors> states) const;

 private:
  struct HookKey {
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key = 0;
  };
  using ShardLoader = std::function<void(int64_t rank, torch::serialize::InputArchive& into)>;
  HookKey hook(size_t k, size_t slot);  ///< installs the post hook on slot's gradient accumulator
  /// Hooks again the parameters of bucket k that autograd gave a new gradient accumulator (a data replaced in
  /// place: C++ Module::load); zero_grad() and stage 3's gathers call it.
  void rehook(size_t k);
  ReadShards read_from(int64_t n_old, const ShardLoader& load, const std::function<std::string(int64_t)>& name_of,
                       const std::string& kind, const std::string& where) const;
  /// "'name' (params[i], shape [a, b])" for messages.
  std::string describe(size_t k, size_t slot) const;
  bool is_master(size_t k) const;  ///< buffer k is 16-bit: its shard parameter is a separate fp32 master
  /// The shard parameter is a copy of the parameters' shard, not a view of it: a 16-bit buffer's master, or
  /// (offload) every buffer's fp32 copy in host memory.
  bool separate_shard(size_t k) const { return is_master(k) || offloaded(); }
  /// Offload: bucket k's reduced gradient shard (on the device) copied into its host gradient.
  void send_to_host(size_t k, const at::Tensor& reduced);
  /// Offload, reducing in the backward: the window's first reduced shard sent (send_to_host), later ones added
  /// to the host gradient.
  void receive_on_host(size_t k, const at::Tensor& reduced, bool accumulate);
  /// Offload: an uninitialised fp32 tensor shaped as `shard` in host memory (pinned when `shard` is on a GPU:
  /// asynchronous copies), outside any MemoryBudget.
  at::Tensor host_like(const at::Tensor& shard) const;
  void begin_timeline();  ///< offload: a step's timeline starts (the reduction)
  at::Tensor data_shard(size_t k) const;
  void install_shard_grads();
  void record_versions(size_t k) const;
  /// The versions of the parameters' .grad in bucket k as ZeroOptimizer or backward's accumulation left them.
  void record_grad_versions(size_t k) const;
  /// The accumulator of a parameter of bucket k, slot i, holds another library's C++ post hook (DDP's).
  bool foreign_reducer_hook(size_t k, size_t i) const;
  void wait_for_bucket(size_t k) const;
  void reduce_in_fp32(size_t k, const at::Tensor& out);
  // reduce_in_backward: a parameter's gradient arrived; a bucket launched, finished; the end of a pass.
  void on_gradient(size_t k, size_t slot);
  void launch(size_t k);
  void finish_oldest();
  void finish_pass();
  /// A backward raised after its first gradient: its end callback never ran (the engine dropped it).
  bool pass_abandoned() const;
  /// Waits for what such a pass launched and forgets it (zero_grad then starts afresh).
  void abandon_pass();

  // stage 3 (zero_units.cpp)
  enum class UnitState { Sharded, Gathering, Full };
  /// check_unit_order: every rank gathers unit u for the same reason, or every rank raises (nothing launched).
  void agree_on_unit(size_t u, GatherFor why);
  void build_units();  ///< the units' buckets; every unit released
  /// Right after bucket k's buffer is made: its full views kept, this rank's shard of the values returned (a
  /// copy), the buffer and its gradient freed, the parameters full-shaped placeholders without bytes (so that
  /// gradient accumulators made later see their shapes). Construction then never holds two units' copies.
  at::Tensor park(size_t k);
  void gather_unit(size_t u, GatherFor why);  ///< launches u's all-gathers (nothing when not Sharded)
  void wait_unit(size_t u, GatherFor why);    ///< u in place: parameters (and existing gradient buffers) attached
  void release_unit(size_t u);  ///< u's full parameters freed, its parameters placeholders
  void release_units();         ///< every unit (stale after a step; the end of a backward)
  /// The parameters with a gradient on this rank (hook or a write by hand), then the maximum over ranks.
  void agree_with_grad();
  enum class Combine : int64_t { FoundInf = 1, GradNorm, Divisor, ForeignScaler };
  /// Every rank's `value` (a float64 tensor of `size()` entries, on value's device) after checking that every
  /// rank combines the same `what`; raises on every rank naming each one's otherwise.
  at::Tensor combine(Combine what, const at::Tensor& value);
  void begin_pass();            ///< the first hook of a backward pass: finish_pass queued at its end
  bool in_backward() const;
  /// The values handed to the all-gather: the fp32 shard parameter, or a 16-bit buffer's rounded shard.
  at::Tensor param_shard(size_t k) const;
  /// Gives bucket k a zeroed flat gradient when it has none (stage 3: without views; its parameters may be
  /// placeholders).
  void ensure_grad(size_t k);

  dist::Communicator comm_;
  ZeroOptions options_;
  StateBlocks blocks_;
  std::vector<bool> blocked_;  ///< per bucket: laid out in whole state blocks
  // offload only
  std::vector<double> copy_begin_s_;    ///< per bucket: when its gradient copy was launched
  std::vector<OffloadEvent> timeline_;
  std::vector<std::optional<c10::Event>> grad_copied_;  ///< per bucket (GPU): its gradient's copy has ended
  std::vector<at::Tensor> host_low_;  ///< per 16-bit bucket (offload): the rounded shard, staged for its copy
  at::Tensor host_scratch_;  ///< offload, reducing in the backward: a later micro-batch's shard, before its sum
  std::chrono::steady_clock::time_point reduction_began_;
  std::string id_;
  int64_t live_key_ = 0;
  int64_t steps_ = 0;
  std::vector<std::unique_ptr<FlatParams>> flats_;  ///< one per bucket
  std::vector<at::Tensor> shards_;       ///< per buffer: the shard parameter handed to the optimizer
  std::vector<at::Tensor> shard_grads_;  ///< per buffer: a separate fp32 gradient shard (stage 2, or 16-bit)
  std::vector<std::pair<size_t, size_t>> slot_of_param_;  ///< params[i] -> (buffer, slot)
  std::vector<std::vector<size_t>> param_of_slot_;         ///< (buffer, slot) -> i
  mutable std::vector<std::vector<uint32_t>> versions_;   ///< 16-bit buffers: each slot's parameter version
  /// Per bucket and slot: the version of the parameter's .grad after our last write or backward's last
  /// accumulation (-1 while it has none); anything else moved it.
  mutable std::vector<std::vector<int64_t>> grad_versions_;
  mutable bool warned_changed_before_ = false, warned_changed_after_ = false, warned_reducer_ = false;
  mutable std::vector<std::optional<dist::Work>> gathers_;  ///< overlap_param_gather: per bucket, not waited yet
  std::unordered_map<const c10::TensorImpl*, size_t> bucket_of_;  ///< a parameter's bucket
  /// Per bucket and slot: a backward reached the parameter since zero_grad(set_to_none=true) (its hook).
  std::vector<std::vector<uint8_t>> has_grad_;
  /// Per bucket and slot: the parameter has a gradient on some rank this step (agreed by reduce_gradients).
  std::vector<std::vector<uint8_t>> with_grad_;
  /// Per bucket and slot: parameters of one class have equal step counters (their steps and skips alike).
  std::vector<std::vector<int64_t>> counter_class_;
  bool reduced_grads_ = false;  ///< the gradients of this step are reduced
  bool stepped_ = false;  ///< stepped since the last zero_grad: the gradients are spent
  bool reattached_ = false;  ///< parameters were copied back in (FlatParams::reattach): masters follow them
  /// Per bucket and slot: the hook on the parameter's gradient accumulator (records its .grad's version;
  /// reduce_in_backward and stage 3: on_gradient).
  std::vector<std::vector<HookKey>> hooks_;
  // reduce_in_backward only
  std::vector<size_t> ready_;              ///< per bucket: gradients arrived in this pass
  size_t next_launch_ = 0;                 ///< buckets launch in order: every rank runs the same collectives
  bool pass_active_ = false;               ///< a backward pass is running (its end callback is queued)
  std::weak_ptr<char> pass_token_;         ///< held by that callback: expired when the engine dropped it
  std::vector<bool> accumulated_;          ///< per bucket: its gradient shard holds a sum since zero_grad()
  /// Launched, not finished: (bucket, work); no work for a 16-bit bucket (reduced in fp32 chunks, waited inside).
  std::deque<std::pair<size_t, std::optional<dist::Work>>> pending_;
  std::vector<at::Tensor> reduced_;        ///< per bucket: the reduced shard of the pass, until finished
  // stage 3 only
  /// Per bucket with a separate shard parameter (16-bit, or offloaded): the device's shard the unit gathers (16-bit:
  /// the rounded master).
  std::vector<at::Tensor> low_shards_;
  std::vector<size_t> unit_of_bucket_;
  std::vector<std::vector<size_t>> unit_buckets_;   ///< per unit: its buckets
  std::vector<UnitState> unit_state_;
  std::vector<std::vector<dist::Work>> unit_works_; ///< per unit: its gathers in flight
  std::vector<size_t> unit_ready_;                  ///< per unit: buckets whose gradients all arrived (this pass)
  /// Per bucket and slot: the parameter's full shape over the bucket's storage (what it is while gathered).
  std::vector<std::vector<at::Tensor>> full_views_;
};

/// What every ZeroOptimizer<Base> offers without its Base: for TrainingState (one file per rank) and Python.
class ShardedOptimizer {
 public:
  virtual ~ShardedOptimizer() = default;
  /// The optimizer itself (for GradScaler, LR schedulers, param_groups()).
  virtual FusedOptimizer& optimizer() = 0;
  virtual ZeroShards& shards() = 0;
  virtual const ZeroShards& shards() const = 0;
  /// "AdamW", "Adam" or "SGD".
  virtual const char* kind() const = 0;

  /// Zeroes the gradients for the next backward (stage 2: allocates the flat gradient again) and points every
  /// parameter's .grad back at the flat buffer. set_to_none (torch's default): the parameters count as without a
  /// gradient (not stepped) until a backward reaches them; false: as torch's zeros, they are stepped. Call this one, not torch::optim::Optimizer::zero_grad (not
  /// virtual: it would drop the shard gradients; the next step then raises).
  virtual void zero_grad(bool set_to_none = true) = 0;

  /// This rank's file (ZeroShards::save_shard).
  virtual void save_shard(const std::string& path) const = 0;
  /// Loads the files of every rank of the saving job (files[r]: rank r's), resharding when the world size
  /// differs and allow_reshard. All or nothing: c10::ValueError with nothing changed (ZeroShards::read_shards).
  virtual void load_shards(const std::vector<std::string>& files, bool allow_reshard) = 0;
  /// The full optimizer state per parameter (torch's state_dict()["state"] entries, in parameter order) on
  /// rank `to`'s host memory; empty on other ranks. Collective.
  virtual std::vector<NamedTensors> consolidate_state(int to) = 0;
  /// Loads a full per-parameter state (consolidate_state's, or a torch optimizer's): every rank keeps its
  /// shard. All or nothing.
  virtual void load_full_state(const std::vector<NamedTensors>& per_param) = 0;

  /// Bytes of this rank's optimizer state tensors (moments, step counters, masters), measured from the tensors.
  virtual int64_t state_bytes() const = 0;
  int64_t gradient_bytes() const { return shards().gradient_bytes(); }
  /// ZeroOptions::overlap_param_gather: wait for the parameters' all-gathers (ZeroShards::wait_for_parameters).
  void wait_for_parameters(const std::vector<at::Tensor>& params) const { shards().wait_for_parameters(params); }
  void wait_for_parameters() const { shards().wait_for_parameters(); }
};

namespace detail {
// Built before Base (a base class listed first), so that Base's constructor gets the shard parameters.
struct ZeroShardsHolder {
  ZeroShards zero_shards;
};
}  // namespace detail

/// ZeRO stage 1 or 2 over Base = AdamW, Adam or SGD (explicitly instantiated; no other Base links).
template <class Base>
class ZeroOptimizer : private detail::ZeroShardsHolder, public Base, public ShardedOptimizer {
 public:
  using Options = typename Base::Options;

  /// Collective: every rank of `communicator` must construct it with the same parameter list (count, shapes,
  /// dtypes; checked with one all-gather of a hash of them). Float32 parameters, or float16/bfloat16 ones
  /// (fp32 master shards, fp32 reduction). c10::ValueError, with the parameters unchanged, for a stage other
  /// than 1 or 2, an option out of range or capturable=true (the step communicates), parameters that differ
  /// across ranks, or what FlatParams refuses (an empty list, a parameter given twice, not a contiguous leaf
  /// requiring grad).
  ZeroOptimizer(std::vector<at::Tensor> params, dist::Communicator communicator, ZeroOptions zero, Options options);
  /// The same with ZeroOptions' defaults but the stage.
  ZeroOptimizer(std::vector<at::Tensor> params, dist::Communicator communicator, int stage, Options options);

  int stage() const { return zero_shards.stage(); }
  const dist::Communicator& communicator() const { return zero_shards.communicator(); }
  size_t bucket_count() const { return zero_shards.bucket_count(); }
  const FlatParams::Bucket& bucket(size_t k) const { return zero_shards.bucket(k); }
  /// The shard parameters Base steps (one per flat buffer): param_groups()[0].params().
  const std::vector<at::Tensor>& shard_params() const { return zero_shards.shard_params(); }

  FusedOptimizer& optimizer() override { return *this; }
  ZeroShards& shards() override { return zero_shards; }
  const ZeroShards& shards() const override { return zero_shards; }
  const char* kind() const override { return Base::name(); }
  void zero_grad(bool set_to_none = true) override;
  /// Refused (c10::ValueError): the optimizer steps one group over its flat buffers. (torch's add_param_group is
  /// not virtual: called through a torch::optim::Optimizer& it adds the group, and the next step refuses it.)
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  /// Reduce-scatters the flat gradients (average over ranks), once per step: the GradScaler calls it before
  /// it reads the gradients, step() when it was not called yet. Collective.
  void prepare_gradients() override { zero_shards.reduce_gradients(); }
  /// The overflow flag, max over ranks (collective).
  at::Tensor global_found_inf(const at::Tensor& found_inf) override { return zero_shards.global_found_inf(found_inf); }
  /// The global L2 norm from this rank's shard norm: sqrt(sum over ranks of norm^2), summed in float64.
  at::Tensor global_grad_norm(const at::Tensor& norm) override { return zero_shards.global_grad_norm(norm); }
  /// The mean of the ranks' divisors (collective; GradScaler::set_grad_divisor calls it).
  at::Tensor global_divisor(const at::Tensor& divisor) override { return zero_shards.global_divisor(divisor); }

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override;

  /// This rank's shard (the same file as save_shard), so that torch::save/load and TrainingState's backup work;
  /// load() takes only a file of this rank at this world size (load_shards reshards).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  void save_shard(const std::string& path) const override;
  void load_shards(const std::vector<std::string>& files, bool allow_reshard) override;
  std::vector<NamedTensors> consolidate_state(int to) override;
  void load_full_state(const std::vector<NamedTensors>& per_param) override;
  int64_t state_bytes() const override;

 protected:
  const char* name() const override { return Base::name(); }
  at::Tensor fresh_step(const at::Tensor& shard) const override;
  bool takes_8bit_states(const at::Tensor& shard) const override;
  std::vector<typename Base::StepPart> step_parts(const at::Tensor& shard, const at::Tensor& step) const override;
  void step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) override;

 private:
  /// A load's states, masters and options, made and checked: what commit() swaps in.
  struct Loaded {
    std::vector<std::unique_ptr<typename Base::ParamState>> states;
    std::vector<at::Tensor> masters;
    std::unique_ptr<Options> options;  ///< null: the options stay
    int64_t steps = 0;
  };
  std::vector<NamedTensors> shard_states() const;
  /// Offload: Base's step on each host shard in turn, each after its gradient arrived, its values sent back.
  void step_on_host(size_t index, const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf);
  /// Makes every state of `states` and checks it, and `options` when given; changes nothing.
  Loaded prepare(std::vector<NamedTensors> states, std::unique_ptr<Options> options, int64_t steps) const;
  /// One load, all or nothing across ranks: `read` (this rank's reading and checks; it may add fields to the
  /// agreement) on every rank, then the agreement of `what`, and only then, on every rank, the swap.
  void load_agreed(const std::string& what, const std::function<Loaded(dist::Agreement&)>& read);
};

ZeroOptimizer(std::vector<at::Tensor>, dist::Communicator, int, AdamWOptions) -> ZeroOptimizer<AdamW>;
ZeroOptimizer(std::vector<at::Tensor>, dist::Communicator, int, AdamOptions) -> ZeroOptimizer<Adam>;
ZeroOptimizer(std::vector<at::Tensor>, dist::Communicator, int, SGDOptions) -> ZeroOptimizer<SGD>;
ZeroOptimizer(std::vector<at::Tensor>, dist::Communicator, ZeroOptions, AdamWOptions) -> ZeroOptimizer<AdamW>;
ZeroOptimizer(std::vector<at::Tensor>, dist::Communicator, ZeroOptions, AdamOptions) -> ZeroOptimizer<Adam>;
ZeroOptimizer(std::vector<at::Tensor>, dist::Communicator, ZeroOptions, SGDOptions) -> ZeroOptimizer<SGD>;

extern template class ZeroOptimizer<AdamW>;
extern template class ZeroOptimizer<Adam>;
extern template class ZeroOptimizer<SGD>;

/// The full parameters in the shard files of every rank of one save (files[r]: rank r's), read without a job
/// (no communicator, any machine): for each flat buffer whose files hold its fp32 values (stage 3's parameters;
/// the fp32 masters of 16-bit buffers at stages 1 and 2), every parameter by its name, in its shape, as fp32
/// (DeepSpeed's zero_to_fp32 does the same); buffers without them (float32 at stages 1 and 2: the model holds
/// them) are left out. c10::ValueError naming the file for files of several saves, of other ranks or world
/// sizes, saved without parameter names, or damaged.
std::vector<std::pair<std::string, at::Tensor>> read_full_parameters(const std::vector<std::string>& files);

}  // namespace gpuops::optim
