// The batch-size search engine and the memory profile (batch_search.h); the Python front end
// (gpuops/batch_size.py) supplies the trial runner and the agreement over torch.distributed.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>  // torch::PyWarningHandler

#include "bindings.h"
#include "py_args.h"
#include "gpuops/batch_search.h"
#include "gpuops/memory_budget.h"

namespace py = pybind11;

namespace gpuops::python {

void bind_batch_search(py::module_& m) {
  py::class_<MemoryProfile>(m, "MemoryProfile")
      .def_readonly("fixed_bytes", &MemoryProfile::fixed_bytes)
      .def_readonly("per_sample_bytes", &MemoryProfile::per_sample_bytes)
      .def_readonly("points", &MemoryProfile::points)
      .def_readonly("linear", &MemoryProfile::linear)
      .def_readonly("note", &MemoryProfile::note)
      .def("predict",
           [](const MemoryProfile& p, const py::object& batch) {
             return p.predict(int_arg("MemoryProfile.predict", "batch", batch));
           },
           py::arg("batch"), "Predicted peak bytes at `batch`.")
      .def("max_batch_for",
           [](const MemoryProfile& p, const py::object& bytes) {
             return p.max_batch_for(int_arg("MemoryProfile.max_batch_for", "bytes", bytes));
           },
           py::arg("bytes"),
           "Largest batch whose predicted peak fits in `bytes` (0 when none).")
      .def("__repr__", [](const MemoryProfile& p) {
        return "MemoryProfile(fixed_bytes=" + std::to_string(static_cast<int64_t>(p.fixed_bytes)) +
               ", per_sample_bytes=" + std::to_string(static_cast<int64_t>(p.per_sample_bytes)) +
               ", linear=" + (p.linear ? "True" : "False") + ")";
      });
  m.def("fit_memory_profile",
        [](const py::object& points, const py::object& tolerance) {
          const std::string where = "fit_memory_profile";
          std::vector<std::pair<int64_t, int64_t>> pairs;
          for (const py::handle point : py::reinterpret_borrow<py::iterable>(points)) {
            const auto pair = point.cast<py::tuple>();
            const std::string at = "points[" + std::to_string(pairs.size()) + "]";
            if (pair.size() != 2) throw py::value_error(where + ": " + at + " must be (batch, peak_bytes)");
            pairs.emplace_back(int_arg(where, at + ".batch", pair[0]), int_arg(where, at + ".peak_bytes", pair[1]));
          }
          return fit_memory_profile(pairs, real_arg(where, "tolerance", tolerance));
        },
        py::arg("points"), py::arg("tolerance") = 0.05);

  py::class_<BatchTrial>(m, "BatchTrial")
      .def_readonly("batch", &BatchTrial::batch)
      .def_readonly("ok", &BatchTrial::ok)
      .def_readonly("peak_bytes", &BatchTrial::peak_bytes)
      .def_readonly("seconds", &BatchTrial::seconds)
      .def_readonly("phase", &BatchTrial::phase)
      .def("__repr__", [](const BatchTrial& t) {
        return "BatchTrial(batch=" + std::to_string(t.batch) + ", ok=" + (t.ok ? "True" : "False") +
               ", peak_bytes=" + std::to_string(t.peak_bytes) + ", phase='" + t.phase + "')";
      });
  py::class_<BatchSearchResult>(m, "BatchSearchResult")
      .def_readonly("max_batch", &BatchSearchResult::max_batch)
      .def_readonly("recommended", &BatchSearchResult::recommended)
      .def_readonly("trials", &BatchSearchResult::trials)
      .def_readonly("profile", &BatchSearchResult::profile)
      .def_readonly("complete", &BatchSearchResult::complete)
      .def_readonly("from_cache", &BatchSearchResult::from_cache)
      .def("__repr__", [](const BatchSearchResult& r) {
        return "BatchSearchResult(max_batch=" + std::to_string(r.max_batch) + ", recommended=" +
               std::to_string(r.recommended) + ", trials=" + std::to_string(r.trials.size()) + ")";
      });

  py::class_<BatchSearchOptions>(m, "BatchSearchOptions")
      .def(py::init<>())
      .def_readwrite("low", &BatchSearchOptions::low)
      .def_readwrite("high", &BatchSearchOptions::high)
      .def_readwrite("multiple_of", &BatchSearchOptions::multiple_of)
      .def_readwrite("margin", &BatchSearchOptions::margin)
      .def_readwrite("profile_seed", &BatchSearchOptions::profile_seed)
      .def_readwrite("seed", &BatchSearchOptions::seed)
      .def_readwrite("headroom_bytes", &BatchSearchOptions::headroom_bytes)
      .def_readwrite("steps_per_trial", &BatchSearchOptions::steps_per_trial)
      .def_readwrite("max_trials", &BatchSearchOptions::max_trials)
      .def_readwrite("max_seconds", &BatchSearchOptions::max_seconds)
      .def_readwrite("cache_file", &BatchSearchOptions::cache_file)
      .def_readwrite("cache_key", &BatchSearchOptions::cache_key)
      .def_readwrite("verbose", &BatchSearchOptions::verbose);
  m.def(
      "default_search_limit", [](const std::string& device) { return default_search_limit(c10::Device(device)); },
      py::arg("device"),
      "gpuops::default_search_limit: on the CPU without an active budget, 90% of the available memory; else -1.");

  // run(batch) -> (ok, peak_bytes, seconds, trace); agree_min(value) -> the minimum over ranks, or None.
  m.def("search_max_batch",
        [](const std::function<std::tuple<bool, int64_t, double, std::vector<int64_t>>(int64_t)>& run,
           const BatchSearchOptions& options, const std::optional<std::function<int64_t(int64_t)>>& agree_min) {
          const TrialRunner runner = [&run](int64_t batch) {
            auto [ok, peak, seconds, trace] = run(batch);
            return TrialOutcome{ok, peak, seconds, std::move(trace)};
          };
          torch::PyWarningHandler warnings;  // TORCH_WARN (a corrupt cache) becomes a Python UserWarning
          try {
            return search_max_batch(runner, options, agree_min ? *agree_min : AgreeMin{});
          } catch (...) {
            warnings.set_in_exception();
            throw;
          }
        },
        py::arg("run"), py::arg("options"), py::arg("agree_min") = py::none());
  m.def("memory_headroom_bytes", [](const std::string& device) { return memory_headroom_bytes(c10::Device(device)); },
        py::arg("device") = "cpu");
}

}  // namespace gpuops::python
