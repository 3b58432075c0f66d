// gpuops._C.ZeroOptimizer (zero_optimizer.h): the C++ sharded optimizer for Python; gpuops.ZeroOptimizer
// (python/gpuops/zero.py) only adds torch.optim's attributes around it. Collective calls release the GIL.
#include <optional>

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor

#include "bindings.h"
#include "py_args.h"
#include "gpuops/zero_optimizer.h"

namespace py = pybind11;

namespace gpuops::python {

namespace {

std::optional<at::Tensor> optional_tensor(const std::string& where, const std::string& name, const py::handle& v) {
  if (v.is_none()) return std::nullopt;
  return tensor_arg(where, name, v);
}

}  // namespace

void bind_zero_optimizer(py::module_& m) {
  using optim::ZeroOptimizer;
  py::class_<ZeroOptimizer>(m, "ZeroOptimizer")
      .def(py::init([](const py::object& params, const dist::Communicator& communicator, const py::object& stage,
                       const py::object& lr, const py::object& betas, const py::object& eps,
                       const py::object& weight_decay) {
             const std::string where = "gpuops.ZeroOptimizer";
             auto tensors = tensor_list_arg(where, "params", params);
             const int64_t s = int_arg(where, "stage", stage);
             if (s != 1 && s != 2)
               throw py::value_error(where + ": stage must be 1 (optimizer state sharded) or 2 (optimizer state "
                                     "and gradients sharded), got " + text_of(stage));
             if (py::isinstance<py::str>(betas) || !py::isinstance<py::sequence>(betas) || py::len(betas) != 2)
               throw py::type_error(where + ": betas must be a pair of numbers, got " + text_of(betas));
             const auto pair = py::reinterpret_borrow<py::sequence>(betas);
             optim::AdamWOptions o(real_arg(where, "lr", lr));
             o.betas({real_arg(where, "betas", pair[0]), real_arg(where, "betas", pair[1])});
             o.eps(real_arg(where, "eps", eps));
             o.weight_decay(real_arg(where, "weight_decay", weight_decay));
             py::gil_scoped_release release;  // collective: one all-gather of the parameters' shapes
             return std::make_unique<ZeroOptimizer>(tensors, communicator, static_cast<int>(s), o);
           }),
           py::arg("params"), py::arg("communicator"), py::arg("stage") = 1, py::arg("lr") = 1e-3,
           py::arg("betas") = py::make_tuple(0.9, 0.999), py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2)
      .def(
          "step",
          [](ZeroOptimizer& z, const py::object& grad_scale, const py::object& found_inf) {
            const std::string where = "ZeroOptimizer.step";
            auto gs = optional_tensor(where, "grad_scale", grad_scale);
            auto fi = optional_tensor(where, "found_inf", found_inf);
            py::gil_scoped_release release;
            z.prepare_gradients();
            z.step_scaled(gs, fi);
          },
          py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none())
      .def("zero_grad", [](ZeroOptimizer& z) { z.zero_grad(); })
      .def("prepare_gradients", &ZeroOptimizer::prepare_gradients, py::call_guard<py::gil_scoped_release>())
      .def("global_found_inf", &ZeroOptimizer::global_found_inf, py::call_guard<py::gil_scoped_release>())
      .def("global_grad_norm", &ZeroOptimizer::global_grad_norm, py::call_guard<py::gil_scoped_release>())
      .def("shard_params", &ZeroOptimizer::shard_params)
      .def_property(
          "lr", [](const ZeroOptimizer& z) { return z.param_groups()[0].options().get_lr(); },
          [](ZeroOptimizer& z, const py::object& lr) {
            const double v = real_arg("ZeroOptimizer.lr", "lr", lr);
            z.param_groups()[0].options().set_lr(v);
          })
      .def_property_readonly("stage", &ZeroOptimizer::stage)
      .def_property_readonly("rank", [](const ZeroOptimizer& z) { return z.communicator().rank(); })
      .def_property_readonly("world_size", [](const ZeroOptimizer& z) { return z.communicator().size(); })
      .def("state_bytes", &ZeroOptimizer::state_bytes)
      .def("gradient_bytes", &ZeroOptimizer::gradient_bytes)
      .def("flat_numels", [](const ZeroOptimizer& z) {
        std::vector<int64_t> n;
        for (const auto& b : z.flat_params().buckets()) n.push_back(b.data.numel());
        return n;
      });
}

}  // namespace gpuops::python
