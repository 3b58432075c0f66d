#pragma once
// Pictures of an estimate as SVG text (`gpuops estimate --plot`, gpuops.estimate_svg). The `gpuops`
// command is a native binary that does not load Python, so it writes SVG itself: no plotting dependency.
// Torch-free; compiled into gpuops_cli_core (src/cli/plot_svg.cpp).

#include <string>
#include <string_view>
#include <vector>

#include "gpuops/estimator.h"

namespace gpuops {

/// One estimated setup, as the picture shows it.
struct EstimatePlot {
  std::string title;                                ///< e.g. "full fine-tune of llama-2-7b" (any bytes)
  std::string subtitle;                             ///< the setup in words (any bytes)
  std::vector<estimator::MemoryBreakdown> phases;   ///< estimate_phases: one per StepPhase, in enum order
  estimator::StepPhase peak_phase = estimator::StepPhase::OptimizerStep;  ///< estimate_memory's peak_phase
  std::string device;                               ///< "cuda" or "cpu": the profile of `phases`
  std::vector<estimator::GpuFit> gpus;              ///< fit_catalog (CUDA profile)
  bool has_micro_batch = true;                      ///< false for a bare parameter count (no activations)
  const estimator::GpuModel* memory_line = nullptr; ///< draw this GPU's memory across the phase chart
};

/// The plot of `model` trained as `setup` on `device`: estimate_phases and estimate_memory's peak on it,
/// fit_catalog under `runtime`, the title "<full|LoRA> fine-tune of <name>" and the setup as subtitle.
/// `memory_line` may be null.
EstimatePlot make_estimate_plot(const estimator::ModelSpec& model, const estimator::TrainingSetup& setup,
                                const estimator::DeviceProfile& device, const estimator::GpuModel* memory_line,
                                const estimator::CudaRuntime& runtime = estimator::CudaRuntime{});

/// A standalone SVG document with one panel per plot, stacked: (a) a stacked bar per StepPhase, by the
/// categories of MemoryBreakdown::items() (fixed colour per category), the peak phase outlined and labelled
/// with its dominant category, GiB axis, a legend and the GPU memory line; (b) the largest micro-batch per
/// catalog GPU, 0 with a label where micro-batch 1 does not fit. Names are escaped for XML.
std::string render_estimate_svg(const std::vector<EstimatePlot>& plots);

/// make_estimate_plot + render_estimate_svg for one setup.
std::string estimate_svg(const estimator::ModelSpec& model, const estimator::TrainingSetup& setup,
                         const estimator::DeviceProfile& device, const estimator::GpuModel* memory_line,
                         const estimator::CudaRuntime& runtime = estimator::CudaRuntime{});

/// Whether `path` names an SVG file (ends in ".svg", any case): what --plot and plot_estimate accept, since the
/// picture is SVG text and nothing else is written.
bool is_svg_name(std::string_view path);

/// Writes `text` to `path` through a temporary file in the same folder, renamed over it (a symlink is
/// followed: its target is replaced). An existing path that is not a regular file (a directory, a device,
/// a FIFO) is refused. std::system_error with the errno on failure; no temporary file is left behind.
void write_file_atomically(const std::string& path, std::string_view text);

}  // namespace gpuops
