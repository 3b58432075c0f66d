#pragma once
// Training states with a sharded optimizer (ZeroOptimizer): one file per rank in the same StateStore state,
// the protocol both TrainingStates (C++ and Python) use, so that it lives once.
//
// Save: rank 0 opens the pending state (files: state.pt and rank-00000.pt ... rank-<N-1>.pt) and tells every
// rank its folder; each rank writes its shard (rank 0 also the main file); the ranks exchange whether they
// succeeded, and only when all did does rank 0 commit (checksums, rename, manifest): a state is complete on
// every rank's behalf or absent. Load: every rank reads the same verified state; the optimizer's files are
// loaded (resharded when the world size changed and that is allowed), and the ranks agree that every rank
// succeeded, or every rank puts its optimizer back and raises. The folder must be shared by the ranks (one
// machine, or a shared file system).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gpuops/state_store.h"
#include "gpuops/zero_optimizer.h"

namespace gpuops {

/// "rank-00003.pt".
std::string shard_file_name(int rank);

/// Saves one state of `step` with every rank's shard of `optimizer`; `write_main(path)` writes rank 0's main
/// file (state.pt). Collective over the optimizer's communicator. Returns the state's folder on every rank.
/// A failure on any rank removes the pending state on rank 0 and raises on every rank, naming the rank.
std::string save_sharded_state(const StateStore& store, int64_t step, const std::string& writer,
                               optim::ShardedOptimizer& optimizer,
                               const std::function<void(const std::string& path)>& write_main);

/// The shard files of a stored (verified) state, in rank order; empty when it has none. c10::ValueError when
/// they are not rank-00000 ... rank-<N-1> without gaps.
std::vector<std::string> shard_files_of(const StoredState& state);

/// Loads the shards into `optimizer` when every rank's `local_error` is empty (what the caller's own part of
/// the load found: model, scaler), then agrees with every rank that all loads succeeded. On any rank's failure
/// every rank's optimizer is as before and every rank raises c10::ValueError naming the first failed rank and
/// its error. Collective.
void load_sharded_state(optim::ShardedOptimizer& optimizer, const std::vector<std::string>& files,
                        bool allow_reshard, const std::string& local_error);

}  // namespace gpuops
