#pragma once
// One registration function per feature; module.cpp calls them all.
#include <pybind11/pybind11.h>

namespace gpuops::python {

void bind_device(pybind11::module_& m);
void bind_memory_budget(pybind11::module_& m);
void bind_estimator(pybind11::module_& m);
void bind_checkpoint(pybind11::module_& m);
void bind_batch_search(pybind11::module_& m);
void bind_flat_params(pybind11::module_& m);
void bind_optim_checks(pybind11::module_& m);
void bind_state_store(pybind11::module_& m);
void bind_communicator(pybind11::module_& m);
void bind_zero_optimizer(pybind11::module_& m);
void bind_telemetry(pybind11::module_& m);

}  // namespace gpuops::python
