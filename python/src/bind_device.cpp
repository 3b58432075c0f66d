#include <pybind11/stl.h>

#include "bindings.h"
#include "py_args.h"
#include "gpuops/device.h"

namespace py = pybind11;

namespace gpuops::python {

void bind_device(py::module_& m) {
  py::class_<DeviceInfo>(m, "DeviceInfo", "The device this process uses (see gpuops.device_info).")
      .def_readonly("type", &DeviceInfo::type)
      .def_readonly("index", &DeviceInfo::index)
      .def_readonly("name", &DeviceInfo::name)
      .def_readonly("total_memory_bytes", &DeviceInfo::total_memory_bytes)
      .def_readonly("free_memory_bytes", &DeviceInfo::free_memory_bytes)
      .def_readonly("multiprocessors", &DeviceInfo::multiprocessors)
      .def_property_readonly("compute_capability",
                             [](const DeviceInfo& d) { return py::make_tuple(d.compute_major, d.compute_minor); })
      .def_readonly("visible_device_count", &DeviceInfo::visible_device_count)
      .def_readonly("cuda_visible_devices", &DeviceInfo::cuda_visible_devices)
      .def_readonly("local_rank", &DeviceInfo::local_rank)
      .def("__repr__", [](const DeviceInfo& d) {
        return "DeviceInfo(type='" + d.type + "', index=" + std::to_string(d.index) + ", name='" + d.name +
               "', total_memory_bytes=" + std::to_string(d.total_memory_bytes) +
               ", free_memory_bytes=" + std::to_string(d.free_memory_bytes) +
               ", multiprocessors=" + std::to_string(d.multiprocessors) + ", compute_capability=(" +
               std::to_string(d.compute_major) + ", " + std::to_string(d.compute_minor) + "))";
      });
  m.def("device_info",
        [](const py::object& index) {
          if (index.is_none()) return device_info(std::nullopt);
          const int64_t i = int_arg("device_info", "index", index);
          if (i < INT32_MIN || i > INT32_MAX)  // device_info's own check names the accepted range
            throw py::value_error("device_info: Invalid index value: " + std::to_string(i) + " (beyond int32)");
          return device_info(static_cast<int>(i));
        },
        py::arg("index") = py::none(),
        "The CUDA device chosen by `index`, else by LOCAL_RANK, else device 0; the CPU when none is visible.");
}

}  // namespace gpuops::python
