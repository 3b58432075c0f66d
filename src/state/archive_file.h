#pragma once
// Writing a torch::serialize archive to a file so that a failed write (a full disk, a file size limit) is an
// error, never the end of the process. Internal header.
#include <string>

#include <torch/serialize/output-archive.h>

namespace gpuops::detail {

/// Writes `archive` to `path` (created, or truncated; a symbolic link is not followed). torch's zip writer
/// throws when a write fails and throws again from its destructor while that exception unwinds, which ends
/// the process (std::terminate); here a failed write is remembered, the writer is told it succeeded, and once
/// it has finished the file is removed and c10::Error names `path` and the system's reason.
void save_archive(torch::serialize::OutputArchive& archive, const std::string& path);

}  // namespace gpuops::detail
