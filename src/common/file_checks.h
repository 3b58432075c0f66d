#pragma once
// What makes a path unusable before C opens it: checks shared by every file gpuops reads or writes (a config,
// a device profile, shard files, training-state folders, pictures). Torch-free; each caller words its own error
// (ArgumentError in the estimator, TORCH_CHECK_VALUE in the LibTorch glue) around the problem returned.
#include <string>

namespace gpuops::detail {

/// "holds a NUL byte" when C would cut `path` there and use another file; "" otherwise.
std::string path_problem(const std::string& path);

/// Why `path` cannot be read as a file without blocking or reading forever, or "": a NUL byte, a missing or
/// unreadable file (with the system's reason), a directory, a FIFO, socket or device.
std::string readable_file_problem(const std::string& path);

}  // namespace gpuops::detail
