// Training states of several ranks (sharded_state.h): the save and load agreements.
#include "gpuops/sharded_state.h"

#include <algorithm>
#include <cstdio>

#include <c10/util/Exception.h>

#include "gpuops/agreement.h"

namespace gpuops {
namespace {

constexpr const char* kMainFile = "state.pt";

}  // namespace

std::string shard_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.pt", rank);
  return name;
}

std::string save_sharded_state(const StateStore* store, int64_t step, const std::string& writer,
                               optim::ShardedOptimizer& optimizer,
                               const std::function<void(const std::string& path, const RankParts& parts)>& write_main,
                               const std::string& local_error, const RankPart& part) {
  auto& comm = optimizer.shards().communicator();
  const int rank = comm.rank(), n = comm.size();
  const std::string what = "TrainingState.save";
  std::vector<std::string> files{kMainFile};
  for (int r = 0; r < n; ++r) files.push_back(shard_file_name(r));
  // 1. Every rank's own checks and the step; rank 0 opens the pending state and proposes its folder.
  PendingState pending;
  dist::Agreement start(what);
  if (!local_error.empty() || !store) start.fail(local_error.empty() ? "no state store" : local_error);
  start.field("step", std::to_string(step));
  for (const auto& [name, value] : part.fields) start.field(name, value);
  if (rank == 0) start.check([&] { pending = store->begin(step, files, writer); });
  start.propose("folder", pending.folder);
  const auto abort_on_failure = [&](const dist::Agreement& agreement) {
    try {
      return agreement.exchange(comm);
    } catch (...) {
      if (!pending.folder.empty() && rank == 0) store->abort(pending);  // nothing stays behind
      throw;
    }
  };
  const std::string folder = abort_on_failure(start).at(0).second;
  if (rank != 0) {
    pending.step = step;
    pending.writer = writer;
    pending.folder = folder;
    pending.files = files;
  }
  // 2. Every rank's own part to every rank; every rank writes its files; they agree that all did; 3. only then
  // does rank 0 commit.
  RankParts parts;
  dist::Agreement written(what);
  written.check([&] { parts = dist::all_gather_bytes(comm, part.own); });
  written.check([&] {
    if (rank == 0) write_main(pending.file_path(kMainFile), parts);
    optimizer.save_shard(pending.file_path(shard_file_name(rank)));
  });
  abort_on_failure(written);
  std::string path;
  dist::Agreement committed(what);
  if (rank == 0) committed.check([&] { path = store->commit(pending).path; });  // removes the folder on failure
  committed.propose("path", path);
  return committed.exchange(comm).at(0).second;
}

std::string save_by_rank_zero(dist::Communicator& comm, int64_t step, const std::string& local_error,
                              const std::function<std::string(const RankParts& parts)>& write, const RankPart& part) {
  const std::string what = "TrainingState.save";
  dist::Agreement start(what);
  if (!local_error.empty()) start.fail(local_error);
  start.field("step", std::to_string(step));
  for (const auto& [name, value] : part.fields) start.field(name, value);
  start.exchange(comm);
  const RankParts parts = dist::all_gather_bytes(comm, part.own);
  std::string path;
  dist::Agreement written(what);
  if (comm.rank() == 0) written.check([&] { path = write(parts); });  // write() leaves nothing behind on failure
  written.propose("path", path);
  return written.exchange(comm).at(0).second;
}

std::vector<std::string> shard_files_of(const StoredState& state) {
  std::vector<std::string> names;
  for (const auto& f : state.files)
    if (f.name.rfind("rank-", 0) == 0) names.push_back(f.name);
  std::sort(names.begin(), names.end());
  std::vector<std::string> paths;
  for (size_t r = 0; r < names.size(); ++r) {
    TORCH_CHECK_VALUE(names[r] == shard_file_name(static_cast<int>(r)), "TrainingState.load: ", state.path,
                      " has shard files that are not rank-00000.pt ... rank-", names.size() - 1, ".pt (found ",
                      names[r], " in place of ", shard_file_name(static_cast<int>(r)), ")");
    paths.push_back(state.file_path(names[r]));
  }
  return paths;
}

std::string state_identity(const StoredState* state) {
  if (!state) return "no state";
  std::string sha = "unknown";
  for (const auto& f : state->files)
    if (f.name == kMainFile && !f.sha256.empty()) sha = f.sha256.substr(0, 16);
  return "step " + std::to_string(state->step) + " (" + state->name + ", " + kMainFile + " sha256 " + sha + ")";
}

void agree_on_state(dist::Communicator& comm, const std::string& identity, const std::string& local_error,
                    const std::vector<std::pair<std::string, std::string>>& fields) {
  dist::Agreement agreement("TrainingState.load");
  if (!local_error.empty()) agreement.fail(local_error);
  agreement.field("the state to load", identity);  // folder copies that differ, a rank seeing none
  for (const auto& [name, value] : fields) agreement.field(name, value);
  agreement.exchange(comm);
}

void agree_loaded(dist::Communicator& comm, const std::string& local_error) {
  dist::Agreement agreement("TrainingState.load");
  if (!local_error.empty()) agreement.fail(local_error);
  agreement.exchange(comm);
}

void load_sharded_state(optim::ShardedOptimizer& optimizer, const std::vector<std::string>& files,
                        bool allow_reshard, const std::string& local_error) {
  auto& comm = optimizer.shards().communicator();
  dist::Agreement agreement("TrainingState.load");
  if (!local_error.empty()) agreement.fail(local_error);
  agreement.check([&] {
    TORCH_CHECK_VALUE(!files.empty(), "the state holds no optimizer shard files (it was saved without a "
                      "ZeroOptimizer)");
  });
  agreement.exchange(comm);
  optimizer.load_shards(files, allow_reshard);  // all or nothing on every rank
}

}  // namespace gpuops
