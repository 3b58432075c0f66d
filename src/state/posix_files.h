#pragma once
// Files for TrainingState, on POSIX calls: durable writes (fsync, rename, fsync the folder), listing, sizes,
// SHA-256. Not std::filesystem: libtorch.so exports its own statically linked copy of those functions, which
// interposes libstdc++'s in every program that links torch, and some of them crash (remove_all calls a null
// pointer with torch 2.11). Internal header.
#include <cstdint>
#include <string>
#include <vector>

namespace gpuops::detail {

/// The folder part of a path ("." when it has none).
std::string parent_of(const std::string& path);

/// `directory/name`.
std::string join_path(const std::string& directory, const std::string& name);

/// mkdir -p; c10::ValueError naming the folder on failure.
void make_directories(const std::string& path);

/// Names in a folder (not "." and ".."); empty when it cannot be read.
std::vector<std::string> list_folder(const std::string& path);

/// Size in bytes, -1 when the file does not exist.
int64_t file_size(const std::string& path);

/// Removes a file; a missing one is fine.
void remove_file(const std::string& path);

/// What lstat says of a path (links are not followed).
struct PathKind {
  bool exists = false, regular = false, folder = false;
  int64_t bytes = -1;
};
PathKind path_kind(const std::string& path);

/// The bytes of a small regular file (a manifest, a checksums file); c10::Error naming it for a link, FIFO,
/// device, a file over `max_bytes` or a read error.
std::string read_small_file(const std::string& path, int64_t max_bytes);

/// Removes a folder and the files in it (one level: the store's folders hold no subfolders).
void remove_folder(const std::string& path);

/// fsyncs `path` (a file or a folder); c10::Error naming it on failure.
void fsync_path(const std::string& path);

/// Renames a complete, fsynced temporary file (or folder) to `path` and fsyncs the parent folder.
void commit_file(const std::string& tmp_path, const std::string& path);

/// Writes `data` to a temporary file next to `path`, fsyncs it, renames it over `path`, fsyncs the folder.
/// On failure (a full disk, an unwritable folder) the temporary file is removed and c10::Error names it.
void write_atomically(const std::string& path, const std::string& data);

/// A fresh tag for a temporary name: "v2-<host>-<pid>-<process nonce>-<counter>", unique across the writers
/// of a shared folder (hosts, processes, containers whose processes share PIDs) and within this process.
std::string temporary_tag();

/// Whether the temporary `name` (at `path`; anything holding ".tmp-") is a leftover to remove: written on this
/// host by a process that is gone (or by an earlier process with this PID), or, for another host's and older
/// names without a tag, untouched for more than `max_age_s` seconds. A live writer's save is never stale.
bool temporary_is_stale(const std::string& path, const std::string& name, int64_t max_age_s);

/// A fresh temporary name for a write to `path`: ".<name>.tmp-<temporary_tag()>" in the same folder.
std::string temporary_name(const std::string& path);

/// Hex SHA-256 of a regular file's bytes, read in blocks; c10::Error for a link, FIFO, device or folder.
std::string sha256_of_file(const std::string& path);

}  // namespace gpuops::detail
