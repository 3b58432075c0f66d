#pragma once
// Training states saved or loaded by several ranks (a sharded optimizer: one file per rank in the same
// StateStore state; or a process group: rank 0 writes, every rank loads): the protocol both TrainingStates
// (C++ and Python) use, so that it lives once. Every step is an agreement (agreement.h): a rank that fails,
// or ranks that differ (the step saved, the state chosen), make every rank raise, naming it.
//
// Save (sharded): every rank's own checks and the step are agreed while rank 0 opens the pending state (files:
// state.pt and rank-00000.pt ... rank-<N-1>.pt) and proposes its folder; each rank writes its shard (rank 0
// also the main file); they agree that all succeeded, and only then does rank 0 commit (checksums, rename,
// manifest): a state is complete on every rank's behalf or absent (rank 0 removes the pending folder).
// Load: every rank picks the newest good state it sees, and the ranks agree on it (name, step and the main
// file's checksum: folder copies whose newest states differ, or a rank that sees none, raise on every rank);
// then each loads its own part (model, scaler) and they agree that all succeeded; then the optimizer's files
// are loaded (resharded when the world size changed and that is allowed), itself all or nothing across ranks.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpuops/communicator.h"
#include "gpuops/state_store.h"
#include "gpuops/zero_optimizer.h"

namespace gpuops {

/// "rank-00003.pt".
std::string shard_file_name(int rank);

/// What each rank brings to a collective save besides its checks.
struct RankPart {
  /// Compared across ranks (with the step): the folder, keep, the model's layout. Ranks that differ raise.
  std::vector<std::pair<std::string, std::string>> fields;
  /// What this rank keeps of its own (its RNG states, data position, extras), serialized by the caller: rank
  /// 0's main file holds every rank's, so that each rank resumes with its own.
  std::string own;
};

/// Every rank's RankPart::own, in rank order: what rank 0's writer puts into the main file.
using RankParts = std::vector<std::string>;

/// Saves one state of `step` with every rank's shard of `optimizer`; `write_main(path, parts)` writes rank 0's
/// main file (state.pt). `local_error`: what the caller's own checks found on this rank (empty: none); `store`
/// may be null only with one (its construction failed). Collective over the optimizer's communicator. Returns
/// the state's folder on every rank. A failure on any rank, or fields that differ, remove the pending state and
/// raise on every rank, naming the rank or the field.
std::string save_sharded_state(const StateStore* store, int64_t step, const std::string& writer,
                               optim::ShardedOptimizer& optimizer,
                               const std::function<void(const std::string& path, const RankParts& parts)>& write_main,
                               const std::string& local_error = "", const RankPart& part = {});

/// A state saved by rank 0 for a process group (no sharded optimizer): every rank's checks, `step` and fields
/// agreed first, every rank's own part gathered, then rank 0 writes through `write(parts)` (returning the
/// state's folder) and every rank hears whether it did. Collective over `comm`; returns the folder on every
/// rank.
std::string save_by_rank_zero(dist::Communicator& comm, int64_t step, const std::string& local_error,
                              const std::function<std::string(const RankParts& parts)>& write,
                              const RankPart& part = {});

/// The shard files of a stored (verified) state, in rank order; empty when it has none. c10::ValueError when
/// they are not rank-00000 ... rank-<N-1> without gaps.
std::vector<std::string> shard_files_of(const StoredState& state);

/// What ranks compare before a collective load: "step N (name, state.pt sha256 ...)", or "no state" for null.
std::string state_identity(const StoredState* state);

/// Collective: the ranks agree on the state each chose to load (state_identity), or that none has one, and on
/// `fields` (the folder, keep, the model's layout); a rank whose own search failed passes `local_error` (e.g.
/// states exist and none can be loaded). Raises on every rank when a rank failed or the choices differ.
void agree_on_state(dist::Communicator& comm, const std::string& identity, const std::string& local_error,
                    const std::vector<std::pair<std::string, std::string>>& fields = {});

/// Collective: every rank's `local_error` (what its own part of the load found: model, optimizer, scaler), so
/// that a rank whose part failed makes every rank raise; the caller puts its objects back then. Raises on
/// every rank naming the first failed rank.
void agree_loaded(dist::Communicator& comm, const std::string& local_error);

/// Loads the shards into `optimizer` once every rank's `local_error` (what the caller's own part of the load
/// found: model, scaler) is known to be empty; all or nothing on every rank (ZeroOptimizer::load_shards).
/// Collective.
void load_sharded_state(optim::ShardedOptimizer& optimizer, const std::vector<std::string>& files,
                        bool allow_reshard, const std::string& local_error);

}  // namespace gpuops
