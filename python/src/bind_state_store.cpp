// gpuops.TrainingState's file protocol: gpuops::StateStore (state_store.h), the same engine C++ uses.
#include <pybind11/stl.h>

#include "bindings.h"
#include "gpuops/state_store.h"

namespace py = pybind11;

namespace gpuops::python {

void bind_state_store(py::module_& m) {
  py::class_<StoredState>(m, "StoredState")
      .def_readonly("step", &StoredState::step)
      .def_readonly("sequence", &StoredState::sequence)
      .def_readonly("name", &StoredState::name)
      .def_readonly("path", &StoredState::path)
      .def_readonly("writer", &StoredState::writer)
      .def_readonly("legacy", &StoredState::legacy)
      .def("file_path", &StoredState::file_path, py::arg("file"));
  py::class_<PendingState>(m, "PendingState")
      .def_readonly("step", &PendingState::step)
      .def_readonly("folder", &PendingState::folder)
      .def("file_path", &PendingState::file_path, py::arg("file"));
  py::class_<StateStore>(m, "StateStore")
      .def(py::init<std::string, int64_t>(), py::arg("directory"), py::arg("keep"))
      .def("begin", &StateStore::begin, py::arg("step"), py::arg("files"), py::arg("writer"))
      .def(
          "commit",
          [](const StateStore& store, const PendingState& pending) {
            std::vector<std::string> warnings;
            StoredState state;
            {
              py::gil_scoped_release release;  // fsyncs and hashes every file
              state = store.commit(pending, &warnings);
            }
            return py::make_tuple(state, warnings);
          },
          py::arg("pending"))
      .def("abort", &StateStore::abort, py::arg("pending"))
      .def("states",
           [](const StateStore& store) {
             std::vector<std::string> warnings;
             auto states = store.states(&warnings);
             return py::make_tuple(states, warnings);
           })
      .def(
          "verify",
          [](const StateStore& store, StoredState& state) {
            bool unverified = false;
            std::string problem;
            {
              py::gil_scoped_release release;  // hashes every file of the state
              problem = store.verify(state, &unverified);
            }
            return py::make_tuple(problem, unverified);
          },
          py::arg("state"));
}

}  // namespace gpuops::python
