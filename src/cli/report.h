#pragma once
// Rendering of CLI results: readable tables (fmt) and one JSON document (nlohmann). Private to src/cli.

#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuops/estimator.h"

namespace gpuops::cli {

/// One estimated configuration with its fit on the GPUs to show.
struct Run {
  std::string label;                         ///< what this setup is, in words
  estimator::ModelSpec model;
  estimator::TrainingSetup setup;
  std::string device;                        ///< "cuda" or "cpu": the profile of `breakdown`
  estimator::MemoryBreakdown breakdown;
  std::vector<estimator::GpuFit> gpus;       ///< always with the CUDA profile
  bool recommend = false;                    ///< gpus holds only fitting GPUs, cheapest first
  std::vector<std::string> notes;
  // --advise GPU: the setup as given on that GPU (CUDA profile) and what to change to fit.
  const estimator::GpuModel* advise_gpu = nullptr;
  estimator::MemoryBreakdown advise_given;
  std::vector<estimator::Advice> advice;
  // For --plot: the profile of `breakdown` and the CUDA software of the GPU table.
  estimator::DeviceProfile profile;
  estimator::CudaRuntime runtime;
};

/// The breakdown and the GPU table of every run.
void print_runs(const std::vector<Run>& runs, std::ostream& out);
/// The GPU table as JSON: per GPU its name, memory, fit, precision support, used bytes and band top, headroom,
/// largest micro-batch (null without an architecture) and price.
nlohmann::json fits_json(const std::vector<estimator::GpuFit>& fits, bool params_only);
/// {"runs": [...]} with bytes as integers.
nlohmann::json runs_json(const std::vector<Run>& runs);

/// The GPU catalog as a table / as {"gpus": [...]}.
void print_gpus(std::ostream& out);
nlohmann::json gpus_json();

/// The presets with their parameter counts as a table / as {"presets": [...]}.
void print_presets(std::ostream& out);
nlohmann::json presets_json();

}  // namespace gpuops::cli
