// gpuops._C: converts types only; the logic lives in the C++ library.
#include <c10/util/Exception.h>

#include "bindings.h"

namespace py = pybind11;

namespace {

// c10 errors surface as the Python exceptions torch itself raises, without the C++ backtrace.
void translate_c10_errors() {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const c10::OutOfMemoryError& e) {
      static py::object torch_oom = py::module_::import("torch").attr("OutOfMemoryError");
      PyErr_SetString(torch_oom.ptr(), e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gpuops native extension (use the gpuops package, not this module directly)";
  translate_c10_errors();
  gpuops::python::bind_device(m);
  gpuops::python::bind_memory_budget(m);
  gpuops::python::bind_estimator(m);
  gpuops::python::bind_checkpoint(m);
  gpuops::python::bind_batch_search(m);
  gpuops::python::bind_flat_params(m);
  gpuops::python::bind_optim_checks(m);
  gpuops::python::bind_state_store(m);
  gpuops::python::bind_communicator(m);
  gpuops::python::bind_zero_optimizer(m);
  gpuops::python::bind_telemetry(m);
}
