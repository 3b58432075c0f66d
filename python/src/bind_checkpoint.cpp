// Checkpointing for Python: segments run by the C++ engine (gpuops::checkpoint), the budget policy's
// knapsack (checkpoint_policy.h) shared by gpuops.apply_checkpointing, and the activation offload store whose
// pack/unpack Python's saved-tensor hooks call (gpuops.offload_activations).
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>  // torch::PyWarningHandler
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor

#include "bindings.h"
#include "py_args.h"
#include "gpuops/activation_offload.h"
#include "gpuops/checkpoint.h"
#include "gpuops/checkpoint_policy.h"

namespace py = pybind11;

namespace gpuops::python {
namespace {

// Rows (name, saved_bytes, checkpointed_bytes, forward_seconds[, offloaded_bytes, offload_seconds]).
std::vector<LayerCost> layer_costs(const std::string& where, const py::object& costs, size_t fields) {
  std::vector<LayerCost> layers;
  for (const py::handle row : py::reinterpret_borrow<py::iterable>(costs)) {
    const auto cost = row.cast<py::tuple>();
    const std::string at = "costs[" + std::to_string(layers.size()) + "]";
    if (cost.size() != fields)
      throw py::value_error(where + ": " + at + " must be (name, saved_bytes, checkpointed_bytes, forward_seconds" +
                            (fields == 6 ? ", offloaded_bytes, offload_seconds)" : ")"));
    LayerCost c{py::str(cost[0]).cast<std::string>(), int_arg(where, at + ".saved_bytes", cost[1]),
                int_arg(where, at + ".checkpointed_bytes", cost[2]), real_arg(where, at + ".forward_seconds", cost[3])};
    if (fields == 6) {
      c.offloaded_bytes = int_arg(where, at + ".offloaded_bytes", cost[4]);
      c.offload_seconds = real_arg(where, at + ".offload_seconds", cost[5]);
    }
    layers.push_back(c);
  }
  return layers;
}

}  // namespace

void bind_checkpoint(py::module_& m) {
  m.def("choose_for_budget",
        [](const py::object& costs, const py::object& budget_bytes, const py::object& units) {
          const std::string where = "choose_for_budget";
          return choose_for_budget(layer_costs(where, costs, 4), int_arg(where, "budget_bytes", budget_bytes),
                                   int_arg(where, "units", units));
        },
        py::arg("costs"), py::arg("budget_bytes"), py::arg("units") = 1 << 16,
        "Indices of the layers to checkpoint; costs: (name, saved_bytes, checkpointed_bytes, forward_seconds).");
  m.def("choose_placements",
        [](const py::object& costs, const py::object& budget_bytes, const py::object& units) {
          const std::string where = "choose_placements";
          std::vector<std::string> out;
          for (const LayerChoice c : choose_placements(layer_costs(where, costs, 6),
                                                       int_arg(where, "budget_bytes", budget_bytes),
                                                       int_arg(where, "units", units)))
            out.push_back(c == LayerChoice::Keep ? "keep" : c == LayerChoice::Offload ? "offload" : "recompute");
          return out;
        },
        py::arg("costs"), py::arg("budget_bytes"), py::arg("units") = 1 << 16,
        "'keep', 'offload' or 'recompute' per layer; costs: (name, saved_bytes, checkpointed_bytes, "
        "forward_seconds, offloaded_bytes, offload_seconds).");

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

  // Called from saved-tensor hooks, with the GIL held: the GIL serialises the forward's packs and the autograd
  // threads' unpacks and releases.
  py::class_<ActivationOffloader>(m, "ActivationOffloader")
      .def(py::init([](const py::object& min_bytes, const py::object& prefetch) {
             const std::string where = "offload_activations";
             ActivationOffloadOptions o;
             o.min_bytes = int_arg(where, "min_bytes", min_bytes);
             o.prefetch = int_arg(where, "prefetch", prefetch);
             return std::make_unique<ActivationOffloader>(o);
           }),
           py::arg("min_bytes") = 1024, py::arg("prefetch") = 1)
      .def("enter_layer", &ActivationOffloader::enter_layer, py::arg("layer"))
      .def("leave_layer", &ActivationOffloader::leave_layer)
      .def("pack", &ActivationOffloader::pack, py::arg("tensor"))
      .def("unpack", &ActivationOffloader::unpack, py::arg("handle"))
      .def("release", &ActivationOffloader::release, py::arg("handle"))
      .def("clear", &ActivationOffloader::clear)
      .def_property_readonly("host_bytes", &ActivationOffloader::host_bytes)
      .def_property_readonly("device_bytes", &ActivationOffloader::device_bytes)
      .def_property_readonly("entries", &ActivationOffloader::entries)
      .def("timeline", [](const ActivationOffloader& o) {
        std::vector<py::tuple> rows;
        for (const auto& e : o.timeline()) rows.push_back(py::make_tuple(e.what, e.layer, e.bytes, e.begin_s, e.end_s));
        return rows;
      });
}

}  // namespace gpuops::python
