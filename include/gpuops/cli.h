#pragma once
// The `gpuops` command line, as a function: the native binary and the Python console script both call it,
// and the tests run it in-process. Torch-free.

#include <ostream>
#include <string>
#include <vector>

#include "gpuops/estimator/device_profile.h"
#include "gpuops/estimator/model_spec.h"
#include "gpuops/estimator/training_setup.h"

namespace gpuops {

/// Runs `gpuops <args>` (args without the program name), writing results to `out` and errors to `err`.
/// Returns 0 on success and for --help, 2 for bad input (one line "gpuops: error: ..." on `err`).
int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

/// The fit table of `gpuops estimate` (its "gpus" JSON array) for a model and setup: every catalog GPU on its
/// own CUDA profile under `runtime`, or with `recommend` only those that fit, cheapest first.
std::string fit_table_json(const estimator::ModelSpec& model, const estimator::TrainingSetup& setup,
                           const estimator::CudaRuntime& runtime, bool recommend);

}  // namespace gpuops
