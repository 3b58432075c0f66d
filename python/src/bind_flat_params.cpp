// FlatParams (flat_params.h) for Python: torch.Tensor parameters through torch's own casters.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor

#include "bindings.h"
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
      .def(py::init([](const std::vector<at::Tensor>& params, int64_t alignment_bytes, int64_t world_size) {
             return FlatParams(params, FlatParamsOptions{alignment_bytes, world_size});
           }),
           py::arg("params"), py::arg("alignment_bytes") = 16, py::arg("world_size") = 1)
      .def_property_readonly("buckets", &FlatParams::buckets)
      .def("flat_parameters", &FlatParams::flat_parameters,
           "One leaf tensor per buffer, its .grad the flat gradient: an optimizer given these steps once per buffer")
      .def("zero_grad", &FlatParams::zero_grad)
      .def("intact", &FlatParams::intact)
      .def_static("shard", &FlatParams::shard, py::arg("flat"), py::arg("rank"), py::arg("world_size"));
}

}  // namespace gpuops::python
