// Checkpointing for Python: segments run by the C++ engine (gpuops::checkpoint), and the budget policy's
// knapsack (checkpoint_policy.h) shared by gpuops.apply_checkpointing.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor

#include "bindings.h"
#include "gpuops/checkpoint.h"
#include "gpuops/checkpoint_policy.h"

namespace py = pybind11;

namespace gpuops::python {

void bind_checkpoint(py::module_& m) {
  m.def("choose_for_budget",
        [](const std::vector<std::tuple<std::string, int64_t, int64_t, double>>& costs, int64_t budget_bytes,
           int64_t units) {
          std::vector<LayerCost> layers;
          for (const auto& [name, saved, checkpointed, seconds] : costs) layers.push_back({name, saved, checkpointed, seconds});
          return choose_for_budget(layers, budget_bytes, units);
        },
        py::arg("costs"), py::arg("budget_bytes"), py::arg("units") = 1 << 16,
        "Indices of the layers to checkpoint; costs: (name, saved_bytes, checkpointed_bytes, forward_seconds).");

  // fn is called with the GIL taken by pybind11's function wrapper, also from the autograd engine's thread
  // during the backward's recomputation.
  m.def("checkpoint_segment",
        [](const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
           const std::vector<at::Tensor>& inputs, bool preserve_rng_state, const std::vector<at::Tensor>& buffers) {
          CheckpointOptions options;
          options.preserve_rng_state = preserve_rng_state;
          options.buffers = buffers;
          return checkpoint(fn, inputs, options);
        },
        py::arg("fn"), py::arg("inputs"), py::arg("preserve_rng_state") = true, py::arg("buffers") = std::vector<at::Tensor>{});
}

}  // namespace gpuops::python
