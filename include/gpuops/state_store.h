#pragma once
// The file protocol of training states, one engine for C++ and Python (gpuops::TrainingState and
// gpuops.TrainingState both save and load through it; a sharded optimizer writes one file per rank into
// the same kind of state).
//
// A state is a folder `state-<step:012d>` (a re-save of the same step: `state-<step:012d>.<n>`) holding
// the serializers' files and `checksums.json` (size and SHA-256 of every file, the step, the writer). A save:
//   1. begin(): a pending folder `.tmp-...` in the store; each serializer writes its files there, straight
//      to disk (nothing is copied through memory);
//   2. commit(): fsync every file, hash it, write checksums.json, fsync, rename the folder into place (one
//      atomic step: the state appears complete or not at all), then rewrite manifest.json and LATEST
//      atomically, then remove what keep-K drops and stale temporaries;
//   abort(): a failed save removes its pending folder.
// The checksums live with the files, so a state is verified without the manifest; the manifest is an index,
// and load() also scans the folder, so a lost or corrupt manifest loses nothing and a save never deletes a
// state it could not vouch for. A state is never renamed over another: a kill at any instant leaves every
// state that was complete before it. Names read from the manifest or a checksums file are confined to the
// store (state names only, plain file names, regular files: no paths, links, devices or FIFOs).
// Folders written before this format (`state-<step>.pt` files listed in a manifest) still load.
#include <cstdint>
#include <string>
#include <vector>

namespace gpuops {

/// One file of a stored state.
struct StoredFile {
  std::string name;    ///< a plain name inside the state's folder, e.g. "state.pt" or "rank-00003.pt"
  int64_t bytes = -1;  ///< -1: unknown (a legacy state found without a manifest)
  std::string sha256;  ///< hex; empty: unknown
};

/// A state found in the store; StateStore::verify tells whether it is complete and intact.
struct StoredState {
  int64_t step = 0;
  int64_t sequence = 0;  ///< orders re-saves of one step (0, 1, ...)
  std::string name;      ///< its name in the store: "state-000000000042" (or "state-000000000042.pt", legacy)
  std::string path;      ///< store directory / name
  std::string writer;    ///< who wrote it ("cpp", "python", ...); empty for legacy states
  bool legacy = false;   ///< one `state-<step>.pt` file written before the folder format
  std::vector<StoredFile> files;  ///< from the manifest; verify() fills them from the folder's checksums

  /// The path of one of its files: the legacy file itself, or `path/name`.
  std::string file_path(const std::string& file) const;
};

/// A save in progress: write each of `files` at file_path(name), then commit or abort it.
struct PendingState {
  int64_t step = 0;
  std::string writer;
  std::string folder;  ///< the pending folder (inside the store, hidden)
  std::vector<std::string> files;
  double started_s = 0;  ///< when begin() made it (steady clock, seconds): commit reports the save's duration

  std::string file_path(const std::string& file) const;
};

class StateStore {
 public:
  /// Creates the folder if needed. c10::ValueError for keep < 1 or a folder that cannot be created
  /// (the message names it).
  StateStore(std::string directory, int64_t keep);

  /// Starts a save of `step` (>= 0) whose serializers will write `files` (plain, distinct names); `writer`
  /// names the format ("cpp", "python"), which load() checks.
  PendingState begin(int64_t step, const std::vector<std::string>& files, const std::string& writer) const;

  /// Makes a pending save durable and visible (see the protocol above); returns the stored state. On failure
  /// the pending folder is removed and the store is as it was. What it noticed on the way (an unreadable
  /// manifest, a broken state it removed) goes to `warnings`, or to TORCH_WARN when that is null.
  StoredState commit(const PendingState& pending, std::vector<std::string>* warnings = nullptr) const;

  /// Removes a pending save's folder (never throws); one this store did not make is left alone.
  void abort(const PendingState& pending) const noexcept;

  /// Every state the manifest lists or the folder holds, newest first (by step, then re-save).
  /// An unreadable manifest is reported in the returned warnings and the folder is scanned.
  std::vector<StoredState> states(std::vector<std::string>* warnings = nullptr) const;

  /// Empty when the state is complete and intact (sizes and SHA-256 of every file); otherwise what is wrong.
  /// Fills `state.files` from the folder's own checksums. A legacy state found without a manifest has no
  /// checksum: it passes with `unverified` set.
  std::string verify(StoredState& state, bool* unverified = nullptr) const;

  const std::string& directory() const { return directory_; }
  int64_t keep() const { return keep_; }

 private:
  /// Whether `pending` is a save begin() made here (its folder `.tmp-...` inside this store, plain file names).
  bool owns(const PendingState& pending) const;
  std::string directory_;
  int64_t keep_;
};

}  // namespace gpuops
