// gpuops.memory_budget: a context manager over the C++ RAII MemoryBudget.
#include <optional>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "py_args.h"
#include "gpuops/memory_budget.h"

namespace py = pybind11;

namespace gpuops::python {
namespace {

c10::Device parse_device(const std::string& text) {
  try {
    return c10::Device(text);
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, "memory_budget: device must be 'cpu' or 'cuda[:index]', got '", text, "'");
  }
}

// The budget starts at __enter__ and ends at __exit__; its last counters stay readable afterwards.
class PyMemoryBudget {
 public:
  PyMemoryBudget(std::optional<int64_t> limit_bytes, const std::string& device)
      : limit_(limit_bytes.value_or(MemoryBudget::kUnlimited)), device_(parse_device(device)) {
    // kUnlimited is how None is stored, not a value to give: -1 would silently mean "no limit".
    TORCH_CHECK_VALUE(!limit_bytes || *limit_bytes > 0, "memory_budget: limit_bytes must be an int > 0 or None, got ",
                      limit_);
    TORCH_CHECK_VALUE(device_.is_cpu() || device_.is_cuda(),
                      "memory_budget: device must be 'cpu' or 'cuda[:index]', got '", device, "'");
  }
  PyMemoryBudget& enter() {
    TORCH_CHECK(!budget_, "memory_budget: this budget is already active; create a new one to nest");
    budget_.emplace(limit_, device_);
    return *this;
  }
  void exit() {
    if (!budget_) return;
    last_ = budget_->stats();
    budget_.reset();
  }
  MemoryStats stats() const { return budget_ ? budget_->stats() : last_; }
  void reset_peak() {
    TORCH_CHECK(budget_, "memory_budget: reset_peak() needs an active budget (inside the `with` block)");
    budget_->reset_peak();
  }
  void start_trace() {
    TORCH_CHECK(budget_, "memory_budget: start_trace() needs an active budget (inside the `with` block)");
    budget_->start_trace();
  }
  std::vector<int64_t> take_trace() { return budget_ ? budget_->take_trace() : std::vector<int64_t>{}; }
  bool active() const { return budget_.has_value(); }
  int64_t limit() const { return limit_; }
  std::string device() const { return device_.str(); }

 private:
  int64_t limit_;
  c10::Device device_;
  std::optional<MemoryBudget> budget_;
  MemoryStats last_;
};

// gpuops._C.unbudgeted(): UnbudgetedScope as a context manager (entered and left on the same thread).
class PyUnbudgeted {
 public:
  void enter() { scope_.emplace(); }
  void exit() { scope_.reset(); }

 private:
  std::optional<UnbudgetedScope> scope_;
};

}  // namespace

void bind_memory_budget(py::module_& m) {
  py::class_<MemoryStats>(m, "MemoryStats")
      .def_readonly("current_bytes", &MemoryStats::current_bytes)
      .def_readonly("peak_bytes", &MemoryStats::peak_bytes)
      .def_readonly("limit_bytes", &MemoryStats::limit_bytes)
      .def_readonly("allocations", &MemoryStats::allocations)
      .def_readonly("failed_allocations", &MemoryStats::failed_allocations);

  py::class_<PyMemoryBudget>(m, "MemoryBudget")
      .def(py::init([](const py::object& limit_bytes, const std::string& device) {
             return std::make_unique<PyMemoryBudget>(
                 limit_bytes.is_none() ? std::nullopt
                                       : std::optional<int64_t>(int_arg("memory_budget", "limit_bytes", limit_bytes)),
                 device);
           }),
           py::arg("limit_bytes") = py::none(), py::arg("device") = "cpu")
      .def("__enter__", &PyMemoryBudget::enter, py::return_value_policy::reference)
      .def("__exit__", [](PyMemoryBudget& self, py::args) { self.exit(); })
      .def("stats", &PyMemoryBudget::stats)
      .def("reset_peak", &PyMemoryBudget::reset_peak)
      .def("_start_trace", &PyMemoryBudget::start_trace,
           "Records the current bytes after each allocation (CPU), for the batch-size search")
      .def("_take_trace", &PyMemoryBudget::take_trace, "Stops recording and returns the trace")
      .def_property_readonly("current_bytes", [](const PyMemoryBudget& b) { return b.stats().current_bytes; })
      .def_property_readonly("peak_bytes", [](const PyMemoryBudget& b) { return b.stats().peak_bytes; })
      .def_property_readonly("limit_bytes", &PyMemoryBudget::limit)
      .def_property_readonly("device", &PyMemoryBudget::device)
      .def_property_readonly("active", &PyMemoryBudget::active);

  py::class_<PyUnbudgeted>(m, "unbudgeted", "Within it, CPU allocations of this thread bypass every memory_budget")
      .def(py::init<>())
      .def("__enter__", [](PyUnbudgeted& self) { self.enter(); })
      .def("__exit__", [](PyUnbudgeted& self, py::args) { self.exit(); });
}

}  // namespace gpuops::python
