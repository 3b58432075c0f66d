// Checkpointing for Python: segments run by the C++ engine (gpuops::checkpoint), and the budget policy's
// knapsack (checkpoint_policy.h) shared by gpuops.apply_checkpointing.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>  // torch::PyWarningHandler
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor

#include "bindings.h"
#include "py_args.h"
#include "gpuops/checkpoint.h"
#include "gpuops/checkpoint_policy.h"

namespace py = pybind11;

namespace gpuops::python {

void bind_checkpoint(py::module_& m) {
  m.def("choose_for_budget",
        [](const py::object& costs, const py::object& budget_bytes, const py::object& units) {
          const std::string where = "choose_for_budget";
          std::vector<LayerCost> layers;
          for (const py::handle row : py::reinterpret_borrow<py::iterable>(costs)) {
            const auto cost = row.cast<py::tuple>();
            const std::string at = "costs[" + std::to_string(layers.size()) + "]";
            if (cost.size() != 4)
              throw py::value_error(where + ": " + at + " must be (name, saved_bytes, checkpointed_bytes, seconds)");
            layers.push_back({py::str(cost[0]).cast<std::string>(), int_arg(where, at + ".saved_bytes", cost[1]),
                              int_arg(where, at + ".checkpointed_bytes", cost[2]),
                              real_arg(where, at + ".forward_seconds", cost[3])});
          }
          return choose_for_budget(layers, int_arg(where, "budget_bytes", budget_bytes), int_arg(where, "units", units));
        },
        py::arg("costs"), py::arg("budget_bytes"), py::arg("units") = 1 << 16,
        "Indices of the layers to checkpoint; costs: (name, saved_bytes, checkpointed_bytes, forward_seconds).");

  // fn is called with the GIL taken by pybind11's function wrapper, also from the autograd engine's thread
  // during the backward's recomputation.
  m.def("checkpoint_segment",
        [](const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
           const std::vector<at::Tensor>& inputs, bool preserve_rng_state, const std::vector<at::Tensor>& buffers,
           bool offload_inputs) {
          CheckpointOptions options;
          options.preserve_rng_state = preserve_rng_state;
          options.buffers = buffers;
          options.offload_inputs = offload_inputs;
          torch::PyWarningHandler warnings;  // TORCH_WARN (no input requires grad) becomes a Python UserWarning
          try {
            return checkpoint(fn, inputs, options);
          } catch (...) {
            warnings.set_in_exception();
            throw;
          }
        },
        py::arg("fn"), py::arg("inputs"), py::arg("preserve_rng_state") = true, py::arg("buffers") = std::vector<at::Tensor>{},
        py::arg("offload_inputs") = false);
}

}  // namespace gpuops::python
