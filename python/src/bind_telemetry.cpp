// gpuops.metrics: the C++ MetricsRecorder (types only; the logic is in src/telemetry).
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>  // torch::PyWarningHandler

#include "bindings.h"
#include "gpuops/communicator.h"
#include "gpuops/telemetry.h"

namespace py = pybind11;

namespace gpuops::python {
namespace {

// Runs `call` without the GIL; a callback's KeyboardInterrupt or SystemExit (telemetry::CallbackStop) is raised
// again as itself once the GIL is back.
template <typename Call>
void released(Call&& call) {
  try {
    py::gil_scoped_release release;
    call();
  } catch (const telemetry::CallbackStop& stop) {
    std::rethrow_exception(stop.original);
  }
}

}  // namespace

void bind_telemetry(py::module_& m) {
  using telemetry::MetricsRecorder;
  using telemetry::Record;
  py::class_<Record>(m, "MetricsRecord")
      .def_readonly("step", &Record::step)
      .def_readonly("first_step", &Record::first_step)
      .def_readonly("figures", &Record::figures)
      .def_readonly("lrs", &Record::lrs)
      .def("to_json", &Record::to_json);
  m.def("metric_figure_names", &telemetry::figure_names);
  py::class_<MetricsRecorder>(m, "MetricsRecorder")
      .def(py::init([](int64_t log_every, const std::string& jsonl, const std::string& csv, int64_t rank,
                       int64_t world_size, bool every_rank_writes, py::object callback, double flops_per_token,
                       double peak_flops, const dist::Communicator* communicator, int64_t prometheus_port,
                       const std::string& prometheus_address, const std::string& job,
                       const std::string& tensorboard, const std::string& gpu_monitor, double gpu_sample_s) {
             telemetry::RecordCallback call;
             if (!callback.is_none()) {
               TORCH_CHECK_TYPE(PyCallable_Check(callback.ptr()), "Recorder: callback must be callable or None");
               call = [callback](const Record& r) {
                 py::gil_scoped_acquire gil;
                 try {
                   callback(r);
                 } catch (py::error_already_set& e) {
                   // A stop the user asked for goes through; anything else becomes a warning, the run goes on.
                   if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit))
                     throw telemetry::CallbackStop{std::current_exception()};
                   throw std::runtime_error(e.what());
                 }
               };
             }
             return std::make_unique<MetricsRecorder>(
                 telemetry::RecorderOptions{log_every, jsonl, csv, rank, world_size, every_rank_writes,
                                            flops_per_token, peak_flops, prometheus_port, prometheus_address, job,
                                            tensorboard, gpu_monitor, gpu_sample_s},
                 call, communicator);
           }),
           py::arg("log_every"), py::arg("jsonl"), py::arg("csv"), py::arg("rank"), py::arg("world_size"),
           py::arg("every_rank_writes"), py::arg("callback") = py::none(), py::arg("flops_per_token") = 0.0,
           py::arg("peak_flops") = 0.0, py::arg("communicator") = nullptr, py::arg("prometheus_port") = -1,
           py::arg("prometheus_address") = "127.0.0.1", py::arg("job") = "gpuops", py::arg("tensorboard") = "",
           py::arg("gpu_monitor") = "", py::arg("gpu_sample_s") = 1.0)
      .def(
          "step_done",
          [](MetricsRecorder& r, int64_t step, std::optional<at::Tensor> loss, std::optional<at::Tensor> grad_norm,
             std::optional<at::Tensor> loss_scale, std::optional<at::Tensor> skipped_steps, std::vector<double> lrs,
             int64_t tokens, int64_t samples, std::optional<double> data_wait_s) {
            torch::PyWarningHandler warnings;  // a failed sink's TORCH_WARN becomes a Python UserWarning
            // Without the GIL, as the communicator's calls: a record's all-reduces wait on c10d's threads (a
            // callback takes the GIL back).
            released([&] {
              r.step_done(step, {std::move(loss), std::move(grad_norm), std::move(loss_scale),
                                 std::move(skipped_steps), std::move(lrs), tokens, samples, data_wait_s});
            });
          },
          py::arg("step"), py::arg("loss"), py::arg("grad_norm"), py::arg("loss_scale"), py::arg("skipped_steps"),
          py::arg("lrs"), py::arg("tokens"), py::arg("samples"), py::arg("data_wait_s") = py::none())
      .def("flush",
           [](MetricsRecorder& r) {
             torch::PyWarningHandler warnings;
             std::optional<Record> record;
             released([&] { record = r.flush(); });
             return record;
           })
      .def("close",
           [](MetricsRecorder& r) {
             torch::PyWarningHandler warnings;
             std::optional<Record> record;
             released([&] { record = r.close(); });
             return record;
           })
      .def_property_readonly("host_reads", &MetricsRecorder::host_reads)
      .def_property_readonly("resumed_after", &MetricsRecorder::resumed_after)
      .def_property_readonly("prometheus_port", &MetricsRecorder::prometheus_port);
  m.def("prometheus_available", &telemetry::prometheus_available);
  m.def("tensorboard_available", &telemetry::tensorboard_available);
}

}  // namespace gpuops::python
