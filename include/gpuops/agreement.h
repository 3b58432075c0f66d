#pragma once
// Ranks agree or fail together (docs/architecture.md, "Agreement between ranks"). Every collective entry point
// of gpuops (ZeroOptimizer's construction and loads, consolidation, TrainingState's save and load) first runs
// its own checks on every rank without changing anything, then one exchange: each rank's failure, if its
// checks failed, and the named fields that every rank must share (layout, options, step, the checkpoint
// chosen). A failure anywhere, or a field that differs, raises on every rank, naming the rank and the field;
// only then does anything change. One exchange is two small all-gathers on the communicator's control device;
// nothing of it runs on the training step's path.
//
// A rank that failed before it reached the C++ entry point (a check in Python) takes part by calling
// exchange() with its failure: the others, waiting in the entry point's own exchange, raise naming it.

#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpuops/communicator.h"

namespace gpuops::dist {

/// One rank's side of an agreement.
class Agreement {
 public:
  /// `what` names the operation in every message ("ZeroOptimizer", "TrainingState.load").
  explicit Agreement(std::string what) : what_(std::move(what)) {}

  /// A value every rank must pass alike, compared in the order added.
  Agreement& field(std::string name, std::string value);
  /// A value rank 0 proposes to every rank (not compared): exchange() returns rank 0's proposals.
  Agreement& propose(std::string name, std::string value);
  /// Records this rank's failure (the first one is kept).
  Agreement& fail(std::string error);
  /// Runs `check`; an exception it throws becomes this rank's failure, and exchange() rethrows it on this rank.
  /// Returns whether it passed; after a failure later checks are not run.
  bool check(const std::function<void()>& check);
  bool failed() const { return !error_.empty(); }
  const std::string& what() const { return what_; }

  /// Rank 0's proposals, by name, after a successful exchange.
  using Proposals = std::vector<std::pair<std::string, std::string>>;

  /// The exchange (collective over `comm`). When a rank failed, every rank raises: the failing rank its own
  /// exception (the one check() caught; c10::ValueError with fail()'s text otherwise), the others
  /// c10::ValueError "<what>: rank R failed: <its error>; nothing was changed on any rank" (R the lowest
  /// failing rank). When a field differs: c10::ValueError on every rank naming the field, rank 0's value and
  /// the first rank with another. Otherwise returns rank 0's proposals.
  Proposals exchange(Communicator& comm) const;

 private:
  struct Field {
    std::string name, value;
    bool compared;
  };
  std::string what_;
  std::string error_;
  std::exception_ptr caught_;
  std::vector<Field> fields_;
};

/// Every rank's `mine`, in rank order, on every rank (collective: two small all-gathers on the communicator's
/// control device). For what each rank keeps of its own, such as TrainingState's per-rank RNG states.
std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine);

/// A short, stable fingerprint of bytes (64-bit FNV-1a, hexadecimal): for fields whose values are long
/// (parameter names, shapes).
std::string fingerprint(const std::string& bytes);

/// A fresh random 64-bit id (hexadecimal): what rank 0 proposes when every rank needs one (Agreement::propose).
std::string random_id();

/// An exact fingerprint of tensors' values (hexadecimal): their bits read as integers, weighted by position and
/// summed with wrap-around, so that it is the same on every rank that holds the same values whatever the order
/// of summation (thread count, device), and differs otherwise but for collisions. One pass over the tensors,
/// on their devices, and one host sync.
std::string fingerprint(const std::vector<at::Tensor>& tensors);

}  // namespace gpuops::dist
