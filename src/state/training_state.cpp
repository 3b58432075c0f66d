// gpuops::TrainingState (training_state.h): torch::serialize archives written and read through the StateStore
// file protocol (state_store.h), the stop flag from signals, agreement over a c10d backend.
#include "gpuops/training_state.h"

#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "../common/file_checks.h"
#include "../common/rng_state.h"
#include "archive_file.h"
#include "posix_files.h"
#include "gpuops/agreement.h"
#include "gpuops/grad_scaler.h"
#include "gpuops/sharded_state.h"
#include "gpuops/state_store.h"

namespace gpuops {
namespace {

constexpr int64_t kFormat = 1;
// Signals are process-wide, TrainingStates are not: our handler is installed for a signal while any live
// object asks for it (the handler found first comes back when the last one goes), and each object compares
// the signal's count with the count it saw when it was made. A set of counters, not one flag, so that two
// objects (or one listing a signal twice) neither reset each other nor uninstall each other's handler.
constexpr int kMaxSignal = 65;
volatile std::sig_atomic_t g_signal_count[kMaxSignal] = {};

void on_signal(int sig) {
  if (sig > 0 && sig < kMaxSignal) g_signal_count[sig] = g_signal_count[sig] + 1;
}

std::mutex g_handlers_mutex;
int g_handler_users[kMaxSignal] = {};
struct sigaction g_original_handler[kMaxSignal];

void write_rng(torch::serialize::OutputArchive& archive) {
  const auto rng = detail::RngState::capture();
  archive.write("cpu", rng.cpu);
  for (size_t d = 0; d < rng.cuda.size(); ++d) archive.write("cuda" + std::to_string(d), rng.cuda[d]);
}

detail::RngState read_rng(torch::serialize::InputArchive& archive) {
  detail::RngState rng;
  archive.read("cpu", rng.cpu);
  at::Tensor device_state;
  for (size_t d = 0; archive.try_read("cuda" + std::to_string(d), device_state); ++d)
    rng.cuda.push_back(device_state.clone());
  return rng;
}

// Everything in a state file, read before anything is applied.
struct Payload {
  TrainingProgress progress;
  detail::RngState rng;
  torch::serialize::InputArchive model, optimizer;
  amp::GradScalerState scaler;
  bool has_model = false, has_optimizer = false;
  /// Every saving rank's own progress and RNG states (several ranks; empty: one process).
  std::vector<std::pair<TrainingProgress, detail::RngState>> ranks;
};

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toInt();
}

// What each rank keeps of its own: data position, extras, RNG states (the main archive holds rank 0's too).
void read_own(torch::serialize::InputArchive& archive, TrainingProgress& progress, detail::RngState& rng_state) {
  progress.data_position = read_int(archive, "data_position");
  torch::serialize::InputArchive extras, rng;
  archive.read("extras", extras);
  progress.extras.clear();
  for (const auto& key : extras.keys()) extras.read(key, progress.extras[key]);
  archive.read("rng", rng);
  rng_state = read_rng(rng);
}

void write_own(torch::serialize::OutputArchive& archive, const TrainingProgress& progress) {
  torch::serialize::OutputArchive extras, rng;
  archive.write("data_position", c10::IValue(progress.data_position));
  for (const auto& [key, value] : progress.extras) extras.write(key, value);
  archive.write("extras", extras);
  write_rng(rng);
  archive.write("rng", rng);
}

void read_payload(const std::string& path, Payload& payload) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  TORCH_CHECK(read_int(archive, "format") == kFormat, "not a gpuops training state of format ", kFormat);
  payload.progress.step = read_int(archive, "step");
  payload.progress.epoch = read_int(archive, "epoch");
  read_own(archive, payload.progress, payload.rng);
  torch::serialize::InputArchive scaler, ranks;
  if (archive.try_read("ranks", ranks)) {
    at::Tensor bytes;
    for (size_t r = 0; ranks.try_read(std::to_string(r), bytes); ++r) {
      TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1, "rank ", r, "'s part is not bytes");
      const at::Tensor contiguous = bytes.contiguous();
      torch::serialize::InputArchive own;
      own.load_from(reinterpret_cast<const char*>(contiguous.data_ptr<uint8_t>()),
                    static_cast<size_t>(contiguous.numel()));
      auto& [progress, rng] = payload.ranks.emplace_back();
      progress.step = payload.progress.step;
      progress.epoch = payload.progress.epoch;
      read_own(own, progress, rng);
    }
  }
  payload.has_model = archive.try_read("model", payload.model);
  payload.has_optimizer = archive.try_read("optimizer", payload.optimizer);
  if (archive.try_read("scaler", scaler)) {
    for (const auto& key : scaler.keys()) {
      c10::IValue value;
      scaler.read(key, value);
      payload.scaler[key] = value.toDouble();
    }
  }
}

// The objects' current state in memory, so that a load that fails half-way puts them back.
struct Backup {
  std::vector<std::pair<at::Tensor, at::Tensor>> model;  // (live tensor, copy)
  std::string optimizer;
  std::optional<amp::GradScalerState> scaler;

  explicit Backup(const TrainingObjects& objects) {
    if (objects.model) {
      for (auto& t : objects.model->parameters()) model.emplace_back(t, t.detach().clone());
      for (auto& t : objects.model->buffers()) model.emplace_back(t, t.detach().clone());
    }
    if (objects.optimizer) {
      torch::serialize::OutputArchive archive;
      objects.optimizer->save(archive);
      std::ostringstream bytes;
      archive.save_to(bytes);
      optimizer = bytes.str();
    }
    if (objects.scaler) scaler = objects.scaler->state_dict();
  }

  // Whether loading changed the shape of a model tensor (torch's Module::load swaps in whatever it reads).
  bool model_shapes_changed() const {
    return std::any_of(model.begin(), model.end(),
                       [](const auto& pair) { return !pair.first.sizes().equals(pair.second.sizes()); });
  }

  void restore(const TrainingObjects& objects) const {
    {
      at::NoGradGuard no_grad;
      for (const auto& [live, copy] : model) live.set_(copy);
    }
    if (objects.optimizer) {
      std::istringstream bytes(optimizer);
      torch::serialize::InputArchive archive;
      archive.load_from(bytes);
      objects.optimizer->load(archive);
    }
    if (objects.scaler) objects.scaler->load_state_dict(*scaler);
  }
};

}  // namespace

struct TrainingState::Handlers {
  std::vector<std::pair<int, std::sig_atomic_t>> seen;  // (signal, its count when this object was made)

  explicit Handlers(const std::vector<int>& signals) {
    std::lock_guard<std::mutex> lock(g_handlers_mutex);
    for (int sig : signals) {
      if (std::any_of(seen.begin(), seen.end(), [&](const auto& s) { return s.first == sig; })) continue;
      if (!install(sig)) {
        release();  // none of ours stays installed
        TORCH_CHECK_VALUE(false, "TrainingState: signals has ", sig, ", which is not a signal that can be caught");
      }
      seen.emplace_back(sig, g_signal_count[sig]);
    }
  }
  ~Handlers() {
    std::lock_guard<std::mutex> lock(g_handlers_mutex);
    release();
  }

  bool caught() const {
    return std::any_of(seen.begin(), seen.end(), [](const auto& s) { return g_signal_count[s.first] != s.second; });
  }

 private:
  static bool install(int sig) {
    if (sig <= 0 || sig >= kMaxSignal || sig == SIGKILL || sig == SIGSTOP) return false;
    if (g_handler_users[sig] == 0) {
      struct sigaction action {};
      action.sa_handler = on_signal;
      sigemptyset(&action.sa_mask);
      if (sigaction(sig, &action, &g_original_handler[sig]) != 0) return false;
    }
    ++g_handler_users[sig];
    return true;
  }
  void release() {
    for (const auto& [sig, count] : seen)
      if (--g_handler_users[sig] == 0) sigaction(sig, &g_original_handler[sig], nullptr);
    seen.clear();
  }
};

TrainingState::TrainingState(std::string directory, TrainingStateOptions options)
    : directory_(std::move(directory)), options_(std::move(options)) {
  TORCH_CHECK_VALUE(options_.keep >= 1, "TrainingState: keep must be >= 1, got ", options_.keep);
  TORCH_CHECK_VALUE(!directory_.empty(), "TrainingState: directory '' must name a folder");
  TORCH_CHECK_VALUE(detail::path_problem(directory_).empty(), "TrainingState: directory '",
                    directory_.substr(0, directory_.find('\0')), "\\0...' holds a NUL byte (C would use another "
                    "folder)");
  detail::make_directories(directory_);
  handlers_ = std::make_unique<Handlers>(options_.signals);
}

TrainingState::~TrainingState() = default;

bool TrainingState::should_stop() {
  if (handlers_->caught()) stop_requested_ = true;
  if (!options_.process_group) return stop_requested_;
  const bool nccl = options_.process_group->getBackendName() == "nccl";
  auto flag = at::full({1}, stop_requested_ ? 1 : 0, at::TensorOptions(at::kInt).device(nccl ? at::kCUDA : at::kCPU));
  std::vector<at::Tensor> tensors{flag};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  options_.process_group->allreduce(tensors, max)->wait();
  stop_requested_ = tensors[0].item<int>() != 0;
  return stop_requested_;
}

namespace {

constexpr const char* kStateFile = "state.pt";

// This rank's own part, as bytes for the gather (sharded_state.h's RankPart::own).
std::string own_part(const TrainingProgress& progress) {
  torch::serialize::OutputArchive archive;
  write_own(archive, progress);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

// `parts`: every rank's own part (several ranks), each kept as a byte tensor under "ranks".
torch::serialize::OutputArchive make_archive(const TrainingProgress& progress, const TrainingObjects& objects,
                                             const RankParts& parts = {}) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(kFormat));
  archive.write("step", c10::IValue(progress.step));
  archive.write("epoch", c10::IValue(progress.epoch));
  write_own(archive, progress);
  if (!parts.empty()) {
    torch::serialize::OutputArchive ranks;
    for (size_t r = 0; r < parts.size(); ++r) {
      at::Tensor bytes = at::empty({static_cast<int64_t>(parts[r].size())}, at::kByte);
      std::memcpy(bytes.data_ptr<uint8_t>(), parts[r].data(), parts[r].size());
      ranks.write(std::to_string(r), bytes);
    }
    archive.write("ranks", ranks);
  }
  if (objects.model) {
    torch::serialize::OutputArchive model;
    objects.model->save(model);
    archive.write("model", model);
  }
  if (objects.optimizer) {
    torch::serialize::OutputArchive optimizer;
    objects.optimizer->save(optimizer);
    archive.write("optimizer", optimizer);
  }
  if (objects.scaler) {
    torch::serialize::OutputArchive scaler;
    for (const auto& [key, value] : objects.scaler->state_dict()) scaler.write(key, c10::IValue(value));
    archive.write("scaler", scaler);
  }
  return archive;
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// What the ranks of a collective save or load must share besides the step: the folder (a rank writing its
// shard or reading elsewhere), keep, the kind of optimizer (sharded on some ranks only: other protocols) and
// the model's layout.
std::vector<std::pair<std::string, std::string>> shared_fields(const std::string& directory, int64_t keep,
                                                               const TrainingObjects& objects) {
  const torch::nn::Module* model = objects.model;
  const std::string kind = !objects.optimizer                                                  ? "none"
                           : dynamic_cast<optim::ShardedOptimizer*>(objects.optimizer) != nullptr ? "sharded"
                                                                                                  : "unsharded";
  std::string layout = "none";
  if (model) {
    std::string described;
    const auto describe = [&](const auto& items) {
      for (const auto& t : items) described += t.key() + c10::str(t.value().sizes(), t.value().scalar_type()) + ";";
    };
    describe(model->named_parameters());
    describe(model->named_buffers());
    layout = dist::fingerprint(described);
  }
  // As given, made absolute (not resolved: node-local copies under one path may be links to other disks).
  char cwd[PATH_MAX];
  const bool relative = directory.empty() || directory[0] != '/';
  const std::string folder = relative && ::getcwd(cwd, sizeof cwd) ? detail::join_path(cwd, directory) : directory;
  return {{"folder", folder}, {"keep", std::to_string(keep)}, {"optimizer", kind}, {"model layout", layout}};
}

}  // namespace

std::string TrainingState::save(const TrainingProgress& progress, const TrainingObjects& objects) {
  // The checks of this rank; with several ranks they are agreed before anyone writes (sharded_state.h).
  std::string local_error =
      progress.step >= 0 ? "" : "TrainingState::save: step must be >= 0, got " + std::to_string(progress.step);
  std::optional<StateStore> store;
  try {
    store.emplace(directory_, options_.keep);
  } catch (const std::exception& e) {
    if (local_error.empty()) local_error = first_line(e.what());
  }
  if (auto* sharded = dynamic_cast<optim::ShardedOptimizer*>(objects.optimizer)) {
    sharded->wait_for_parameters();  // overlap_param_gather: the model is saved as the step left it
    // Stage 3 between a forward and its backward (reshard_after_forward=false): the model's parameters are full
    // there and placeholders in every later model, which could then never load the state.
    if (local_error.empty() && sharded->shards().stage() == 3 && sharded->shards().gathered_bytes() > 0)
      local_error = "TrainingState::save: stage-3 units are gathered now (between a forward and its backward, or "
                    "a unit kept by reshard_after_forward=false): the model would be saved with full parameters "
                    "that no later model can load; save between steps";
    // One file per rank (sharded_state.h); state.pt holds the rest, written by rank 0.
    TrainingObjects rest = objects;
    rest.optimizer = nullptr;
    return save_sharded_state(store ? &*store : nullptr, progress.step, "cpp", *sharded,
                              [&](const std::string& file, const RankParts& parts) {
                                auto archive = make_archive(progress, rest, parts);
                                detail::save_archive(archive, file);
                              },
                              local_error, {shared_fields(directory_, options_.keep, objects), own_part(progress)});
  }
  const auto write = [&](const RankParts& parts) {
    TORCH_CHECK(store, local_error);  // (rank 0 alone reaches here, and only when it had no error)
    const PendingState pending = store->begin(progress.step, {kStateFile}, "cpp");
    try {
      const std::string file = pending.file_path(kStateFile);
      try {
        auto archive = make_archive(progress, objects, parts);
        detail::save_archive(archive, file);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "TrainingState::save: cannot write ", file, " (", first_line(e.what_without_backtrace()), ")");
      }
    } catch (...) {
      store->abort(pending);
      throw;
    }
    return store->commit(pending).path;
  };
  if (!options_.process_group) {
    TORCH_CHECK_VALUE(local_error.empty(), local_error);
    return write({});
  }
  auto comm = dist::Communicator::from_backend(options_.process_group);
  // rank 0 writes; every rank hears how it went
  return save_by_rank_zero(comm, progress.step, local_error, write,
                           {shared_fields(directory_, options_.keep, objects), own_part(progress)});
}

namespace {

// The model, optimizer and scaler from a payload, and the RNG states when asked: all or nothing on this rank.
// `agree`, with several ranks, learns whether every rank's part succeeded; when one failed, this rank's objects
// are put back too.
void load_objects(const TrainingObjects& objects, Payload& payload, const std::string& path, bool restore_rng,
                  const std::function<void(const std::string& error)>& agree = nullptr) {
  const Backup backup(objects);
  const detail::RngState rng_before = detail::RngState::capture();
  std::string error;
  try {
    TORCH_CHECK_VALUE(!objects.model || payload.has_model, "the state holds no model");
    TORCH_CHECK_VALUE(!objects.optimizer || payload.has_optimizer, "the state holds no optimizer");
    if (objects.model) {
      objects.model->load(payload.model);
      TORCH_CHECK(!backup.model_shapes_changed(), "a tensor of the saved model has another shape");
    }
    if (objects.optimizer) objects.optimizer->load(payload.optimizer);
    if (objects.scaler && !payload.scaler.empty()) objects.scaler->load_state_dict(payload.scaler);
    if (restore_rng) payload.rng.restore();
  } catch (const std::exception& e) {
    error = "TrainingState::load: " + path + " does not fit the objects given (" + first_line(e.what()) +
            "); nothing was changed";
  }
  const auto put_back = [&] {
    backup.restore(objects);
    rng_before.restore();
  };
  if (!error.empty()) put_back();
  try {
    if (agree) agree(error);
  } catch (...) {
    if (error.empty()) put_back();  // another rank failed
    throw;
  }
  TORCH_CHECK_VALUE(error.empty(), error);
}

// The newest state this store holds that verifies and reads, with its payload; problems of the newer ones are
// warned about. None when the store is empty; `error` says why when states exist but none can be loaded.
std::optional<StoredState> newest_good(const StateStore& store, const std::string& directory, Payload& payload,
                                       std::string& error) {
  std::vector<std::string> problems;
  for (StoredState& state : store.states()) {
    bool unverified = false;
    std::string problem = store.verify(state, &unverified);
    if (problem.empty() && !state.legacy && state.writer != "cpp")
      problem = state.path + " was written by the " + state.writer +
                " TrainingState (a state is resumed by the language that wrote it)";
    if (problem.empty()) {
      if (unverified) TORCH_WARN("TrainingState: ", state.path, " has no checksum (no manifest lists it); loading it unverified");
      try {
        read_payload(state.file_path(kStateFile), payload);
      } catch (const std::exception& e) {
        problem = state.file_path(kStateFile) + " cannot be read (" + first_line(e.what()) + ")";
      }
    }
    if (problem.empty()) return state;
    problems.push_back(problem);
    TORCH_WARN("TrainingState: ", problem, "; trying the previous state");
  }
  if (!problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += "\n  " + p;
    error = "TrainingState::load: " + directory + " holds " + std::to_string(problems.size()) +
            " state(s) and none can be loaded:" + all + "\nMove or delete them to start afresh; nothing was changed.";
  }
  return std::nullopt;
}

// This rank's own data position, extras and RNG states in place of rank 0's (a state saved by several ranks).
void take_own_part(Payload& payload, int rank, const std::string& path) {
  if (payload.ranks.empty()) return;
  const size_t saved = payload.ranks.size();
  if (static_cast<size_t>(rank) >= saved) {
    TORCH_WARN("TrainingState::load: ", path, " was saved by ", saved, " ranks: rank ", rank, " has no data "
               "position, extras or RNG states of its own there and takes rank 0's (every saved rank's are in the "
               "result's ranks)");
    return;
  }
  payload.progress = payload.ranks[rank].first;
  payload.rng = payload.ranks[rank].second;
}

}  // namespace

std::optional<LoadedState> TrainingState::load(const TrainingObjects& objects, bool restore_rng, bool allow_reshard) {
  auto* sharded = dynamic_cast<optim::ShardedOptimizer*>(objects.optimizer);
  Payload payload;
  std::string search_error;
  std::optional<StoredState> state;
  try {
    state = newest_good(StateStore(directory_, options_.keep), directory_, payload, search_error);
  } catch (const std::exception& e) {
    search_error = "TrainingState::load: " + first_line(e.what());
  }
  // With several ranks, they agree on the state (or on none) before anyone loads (sharded_state.h).
  std::optional<dist::Communicator> comm;
  if (sharded) {
    comm = sharded->shards().communicator();
  } else if (options_.process_group) {
    comm = dist::Communicator::from_backend(options_.process_group);
  }
  if (comm) {
    agree_on_state(*comm, state_identity(state ? &*state : nullptr), search_error,
                   shared_fields(directory_, options_.keep, objects));
    if (state) take_own_part(payload, comm->rank(), state->path);
  } else {
    TORCH_CHECK(search_error.empty(), search_error);
  }
  if (!state) return std::nullopt;
  if (sharded) {  // the model and scaler here, agreed by every rank; then the shards, all or nothing
    TrainingObjects rest = objects;
    rest.optimizer = nullptr;
    std::vector<std::string> files;
    load_objects(rest, payload, state->path, restore_rng, [&](const std::string& error) {
      std::string local = error;
      if (local.empty()) {
        try {
          files = shard_files_of(*state);
        } catch (const std::exception& e) {
          local = first_line(e.what());
        }
      }
      load_sharded_state(*sharded, files, allow_reshard, local);
    });
  } else if (comm) {
    load_objects(objects, payload, state->path, restore_rng, [&](const std::string& error) { agree_loaded(*comm, error); });
  } else {
    load_objects(objects, payload, state->path, restore_rng);
  }
  LoadedState loaded;
  static_cast<TrainingProgress&>(loaded) = std::move(payload.progress);
  loaded.path = state->path;
  for (auto& rank : payload.ranks) loaded.ranks.push_back(std::move(rank.first));
  return loaded;
}

}  // namespace gpuops
