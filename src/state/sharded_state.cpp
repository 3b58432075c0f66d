// Training states with a sharded optimizer (sharded_state.h): the save and load agreements over the
// optimizer's communicator.
#include "gpuops/sharded_state.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace gpuops {
namespace {

constexpr const char* kMainFile = "state.pt";
constexpr int64_t kTextBytes = 4096;  // a folder name or the first line of an error

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Every rank's text (truncated to kTextBytes), gathered on every rank through the communicator, on the device
// its collectives serve (the shard parameters').
std::vector<std::string> all_gather_text(optim::ShardedOptimizer& optimizer, const std::string& text) {
  auto& comm = optimizer.shards().communicator();
  const auto device = optimizer.shards().shard_params()[0].device();
  at::Tensor mine = at::zeros({kTextBytes}, at::kByte);
  std::memcpy(mine.data_ptr<uint8_t>(), text.data(), std::min<int64_t>(kTextBytes, text.size()));
  at::Tensor all = at::empty({kTextBytes * comm.size()}, at::TensorOptions(at::kByte).device(device));
  comm.all_gather(mine.to(device), all).wait();
  all = all.cpu();
  std::vector<std::string> texts;
  for (int r = 0; r < comm.size(); ++r) {
    const char* begin = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * kTextBytes;
    texts.emplace_back(begin, strnlen(begin, kTextBytes));
  }
  return texts;
}

// The first rank whose text is not empty, or -1.
int first_failed(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) return static_cast<int>(r);
  return -1;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return first_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return first_line(e.what());
  }
  return "";
}

}  // namespace

std::string shard_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.pt", rank);
  return name;
}

std::string save_sharded_state(const StateStore& store, int64_t step, const std::string& writer,
                               optim::ShardedOptimizer& optimizer,
                               const std::function<void(const std::string& path)>& write_main) {
  const auto& comm = optimizer.shards().communicator();
  const int rank = comm.rank(), n = comm.size();
  // 1. Rank 0 opens the pending state and tells every rank where it is (or why it could not).
  std::vector<std::string> files{kMainFile};
  for (int r = 0; r < n; ++r) files.push_back(shard_file_name(r));
  PendingState pending;
  std::string opened;
  if (rank == 0) {
    const std::string error = error_of([&] { pending = store.begin(step, files, writer); });
    opened = error.empty() ? "+" + pending.folder : "-" + error;
  }
  opened = all_gather_text(optimizer, opened)[0];
  TORCH_CHECK(opened.rfind('+', 0) == 0, "TrainingState.save: rank 0 could not start the state of step ", step,
              " in ", store.directory(), " (", opened.substr(1), "); nothing was saved");
  if (rank != 0) {
    pending.step = step;
    pending.writer = writer;
    pending.folder = opened.substr(1);
    pending.files = files;
  }
  // 2. Every rank writes its files; 3. they agree; rank 0 commits only when every rank succeeded.
  const std::string error = error_of([&] {
    if (rank == 0) write_main(pending.file_path(kMainFile));
    optimizer.save_shard(pending.file_path(shard_file_name(rank)));
  });
  const auto errors = all_gather_text(optimizer, error);
  std::string committed;
  if (rank == 0) {
    if (first_failed(errors) >= 0) {
      store.abort(pending);
    } else {
      const std::string commit_error = error_of([&] { committed = "+" + store.commit(pending).path; });
      if (!commit_error.empty()) committed = "-" + commit_error;
    }
  }
  const int failed = first_failed(errors);
  TORCH_CHECK(failed < 0, "TrainingState.save: rank ", failed, " could not write its part of the state of step ",
              step, " (", errors[failed], "); nothing was saved");
  committed = all_gather_text(optimizer, committed)[0];
  TORCH_CHECK(committed.rfind('+', 0) == 0, "TrainingState.save: rank 0 could not commit the state of step ", step,
              " (", committed.substr(1), "); nothing was saved");
  return committed.substr(1);
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

void load_sharded_state(optim::ShardedOptimizer& optimizer, const std::vector<std::string>& files,
                        bool allow_reshard, const std::string& local_error) {
  const auto before = all_gather_text(optimizer, local_error);
  const int failed_before = first_failed(before);
  TORCH_CHECK_VALUE(failed_before < 0, "TrainingState.load: rank ", failed_before, " could not load the state (",
                    before[failed_before], "); nothing was changed");
  // This rank's optimizer as it is, to put back if another rank fails.
  std::ostringstream backup;
  {
    torch::serialize::OutputArchive archive;
    optimizer.optimizer().save(archive);
    archive.save_to(backup);
  }
  const std::string error = error_of([&] {
    TORCH_CHECK_VALUE(!files.empty(), "the state holds no optimizer shard files (it was saved without a "
                      "ZeroOptimizer)");
    optimizer.load_shards(files, allow_reshard);
  });
  const auto errors = all_gather_text(optimizer, error);
  const int failed = first_failed(errors);
  if (failed < 0) return;
  if (error.empty()) {  // this rank loaded: put it back
    std::istringstream bytes(backup.str());
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    optimizer.optimizer().load(archive);
  }
  TORCH_CHECK_VALUE(false, "TrainingState.load: rank ", failed, " could not load its optimizer shard (",
                    errors[failed], "); nothing was changed");
}

}  // namespace gpuops
