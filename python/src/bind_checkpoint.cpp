// The budget policy's knapsack (checkpoint_policy.h), shared by gpuops.apply_checkpointing.
#include <pybind11/stl.h>

#include "bindings.h"
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
}

}  // namespace gpuops::python
