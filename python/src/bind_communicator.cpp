// gpuops.dist (communicator.h) for Python: a torch.distributed group arrives as
// c10::intrusive_ptr<c10d::ProcessGroup> through torch's own pybind11 caster (torch_python), no gloo
// headers here. Blocking calls release the GIL.
#include <chrono>

#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor, intrusive_ptr holders

#include "bindings.h"
#include "py_args.h"
#include "gpuops/agreement.h"
#include "gpuops/communicator.h"

namespace py = pybind11;

namespace gpuops::python {

namespace {

dist::ReduceOp reduce_op_arg(const std::string& where, const py::handle& value) {
  if (py::isinstance<py::str>(value)) {
    const auto s = value.cast<std::string>();
    if (s == "sum") return dist::ReduceOp::Sum;
    if (s == "avg") return dist::ReduceOp::Average;
    if (s == "max") return dist::ReduceOp::Max;
    if (s == "min") return dist::ReduceOp::Min;
  }
  throw py::value_error(where + ": op must be one of 'sum', 'avg', 'max', 'min', got " + text_of(value));
}

dist::CommunicatorOptions options_arg(const std::string& where, const py::handle& timeout,
                                      const std::string& name = "timeout") {
  dist::CommunicatorOptions o;
  const double seconds = real_arg(where, name, timeout);
  if (!(seconds > 0) || seconds > 365.0 * 86400.0)
    throw py::value_error(where + ": Invalid " + name + " value: " + text_of(timeout) +
                          " (seconds; accepted: more than 0, at most a year)");
  o.timeout = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(seconds * 1000.0)));
  return o;
}

}  // namespace

void bind_communicator(py::module_& m) {
  py::class_<dist::Work>(m, "CommWork")
      .def("wait", &dist::Work::wait, py::call_guard<py::gil_scoped_release>(),
           "Blocks until done (at most the communicator's timeout); raises naming the collective otherwise")
      .def("is_completed", &dist::Work::is_completed)
      .def_property_readonly("name", &dist::Work::name);
  py::class_<dist::Communicator>(m, "Communicator")
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const py::object& timeout) {
             return dist::Communicator(group, options_arg("gpuops.dist.Communicator", timeout));
           }),
           py::arg("group"), py::arg("timeout") = 300.0)
      .def_static(
          "from_environment",
          [](const py::object& timeout, const py::object& rendezvous_timeout) {
            const std::string where = "gpuops.dist.Communicator.from_environment";
            auto o = options_arg(where, timeout);
            o.rendezvous_timeout = options_arg(where, rendezvous_timeout, "rendezvous_timeout").timeout;
            py::gil_scoped_release release;
            return dist::Communicator::from_environment(o);
          },
          py::arg("timeout") = 300.0, py::arg("rendezvous_timeout") = 300.0)
      .def_property_readonly("rank", &dist::Communicator::rank)
      .def_property_readonly("size", &dist::Communicator::size)
      .def_property_readonly("timeout", [](const dist::Communicator& c) { return c.timeout().count() / 1000.0; })
      .def("shard", [](const dist::Communicator& c, const py::object& buffer) {
             return c.shard(tensor_arg("Communicator.shard", "buffer", buffer));
           }, py::arg("buffer"))
      .def("reduce_scatter",
           [](dist::Communicator& c, const py::object& buffer, const py::object& op) {
             const std::string where = "Communicator.reduce_scatter";
             auto t = tensor_arg(where, "buffer", buffer);
             auto o = reduce_op_arg(where, op);
             py::gil_scoped_release release;
             return c.reduce_scatter(t, o);
           },
           py::arg("buffer"), py::arg("op") = "sum")
      .def("all_gather",
           [](dist::Communicator& c, const py::object& buffer) {
             auto t = tensor_arg("Communicator.all_gather", "buffer", buffer);
             py::gil_scoped_release release;
             return c.all_gather(t);
           },
           py::arg("buffer"))
      .def("all_reduce",
           [](dist::Communicator& c, const py::object& buffer, const py::object& op) {
             const std::string where = "Communicator.all_reduce";
             auto t = tensor_arg(where, "buffer", buffer);
             auto o = reduce_op_arg(where, op);
             py::gil_scoped_release release;
             return c.all_reduce(t, o);
           },
           py::arg("buffer"), py::arg("op") = "sum")
      .def("barrier", &dist::Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def(
          "traffic",
          [](const dist::Communicator& c) {
            // {"reduce_scatter": {"calls", "payload_bytes", "ring_sent_bytes"}, ..., "ring_sent_bytes": total}
            const dist::Traffic t = c.traffic();
            py::dict d;
            const auto one = [](const dist::TrafficCount& x) {
              py::dict e;
              e["calls"] = x.calls;
              e["payload_bytes"] = x.payload_bytes;
              e["ring_sent_bytes"] = x.ring_sent_bytes;
              return e;
            };
            d["reduce_scatter"] = one(t.reduce_scatter);
            d["all_gather"] = one(t.all_gather);
            d["all_reduce"] = one(t.all_reduce);
            d["ring_sent_bytes"] = t.ring_sent_bytes();
            return d;
          })
      .def("reset_traffic", &dist::Communicator::reset_traffic)
      .def(
          "agree",
          [](dist::Communicator& c, const std::string& what, const std::string& error,
             const std::vector<std::pair<std::string, std::string>>& fields,
             const std::vector<std::pair<std::string, std::string>>& proposals) {
            dist::Agreement a(what);
            if (!error.empty()) a.fail(error);
            for (const auto& [name, value] : fields) a.field(name, value);
            for (const auto& [name, value] : proposals) a.propose(name, value);
            py::gil_scoped_release release;
            return a.exchange(c);
          },
          py::arg("what"), py::arg("error") = "", py::arg("fields") = std::vector<std::pair<std::string, std::string>>{},
          py::arg("proposals") = std::vector<std::pair<std::string, std::string>>{},
          "One agreement (gpuops/agreement.h): every rank's error and fields; ValueError on every rank naming the "
          "failed rank or the field that differs; returns rank 0's proposals as (name, value) pairs. Collective.")
      .def(
          "all_gather_bytes",
          [](dist::Communicator& c, const py::bytes& mine) {
            std::string bytes = mine;
            std::vector<std::string> all;
            {
              py::gil_scoped_release release;
              all = dist::all_gather_bytes(c, bytes);
            }
            py::list out;
            for (const auto& b : all) out.append(py::bytes(b));
            return out;
          },
          py::arg("mine"), "Every rank's bytes, in rank order, on every rank. Collective.");
}

}  // namespace gpuops::python
