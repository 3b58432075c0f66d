#pragma once
// The `gpuops` command line, as a function: the native binary and the Python console script both call it,
// and the tests run it in-process. Torch-free.

#include <ostream>
#include <string>
#include <vector>

namespace gpuops {

/// Runs `gpuops <args>` (args without the program name), writing results to `out` and errors to `err`.
/// Returns 0 on success and for --help, 2 for bad input (one line "gpuops: error: ..." on `err`).
int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace gpuops
