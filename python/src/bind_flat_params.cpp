// FlatParams (flat_params.h) for Python: torch.Tensor parameters through torch's own casters.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor

#include "bindings.h"
#include "py_args.h"
#include "gpuops/flat_params.h"

namespace py = pybind11;

namespace gpuops::python {

void bind_flat_params(py::module_& m) {
  py::class_<FlatParams::Bucket>(m, "FlatBucket")
      .def_property_readonly("device", [](const FlatParams::Bucket& b) { return b.device.str(); })
      .def_readonly("data", &FlatParams::Bucket::data)
      .def_readonly("grad", &FlatParams::Bucket::grad)
      .def_property_readonly("slots", [](const FlatParams::Bucket& b) {
        std::vector<std::tuple<at::Tensor, int64_t, int64_t>> slots;
        for (const auto& s : b.slots) slots.emplace_back(s.param, s.offset, s.numel);
        return slots;
      }, "(parameter, offset, numel) in elements");
  py::class_<FlatParams>(m, "FlatParams")
      .def(py::init([](const py::object& params, const py::object& alignment_bytes, const py::object& world_size) {
             return FlatParams(tensor_list_arg("FlatParams", "params", params),
                               FlatParamsOptions{int_arg("FlatParams", "alignment_bytes", alignment_bytes),
                                                 int_arg("FlatParams", "world_size", world_size)});
           }),
           py::arg("params"), py::arg("alignment_bytes") = 16, py::arg("world_size") = 1)
      .def_property_readonly("buckets", &FlatParams::buckets)
      .def("flat_parameters", &FlatParams::flat_parameters,
           "One leaf tensor per buffer, its .grad the flat gradient: an optimizer given these steps once per buffer")
      .def("zero_grad", &FlatParams::zero_grad)
      .def("intact", &FlatParams::intact)
      .def_static("shard",
                  [](const py::object& flat, const py::object& rank, const py::object& world_size) {
                    const std::string where = "FlatParams.shard";
                    return FlatParams::shard(tensor_arg(where, "flat", flat), int_arg(where, "rank", rank),
                                             int_arg(where, "world_size", world_size));
                  },
                  py::arg("flat"), py::arg("rank"), py::arg("world_size"));
}

}  // namespace gpuops::python
