#pragma once
// Python arguments converted by hand, each error naming the argument: pybind11's own conversion failure is
// a TypeError listing the whole signature, and a Python int past int64 takes the same path.
#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Check / _Unpack

namespace gpuops::python {

inline std::string text_of(const pybind11::handle& value) { return pybind11::repr(value).cast<std::string>(); }

/// A real number (int, float, numpy scalar, one-element tensor); TypeError naming `name` otherwise.
inline double real_arg(const std::string& where, const std::string& name, const pybind11::handle& value) {
  const bool text = pybind11::isinstance<pybind11::str>(value) || pybind11::isinstance<pybind11::bytes>(value);
  if (!value.is_none() && !text && PyNumber_Check(value.ptr())) {
    const double v = PyFloat_AsDouble(value.ptr());
    if (!(v == -1.0 && PyErr_Occurred())) return v;
    const bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (overflow)
      throw pybind11::value_error(where + ": Invalid " + name + " value: " + text_of(value) + " (beyond a double)");
  }
  throw pybind11::type_error(where + ": " + name + " must be a real number, got " + text_of(value));
}

/// A Python int (or numpy integer; not bool or float); TypeError / ValueError naming `name` otherwise.
inline int64_t int_arg(const std::string& where, const std::string& name, const pybind11::handle& value) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr()))
    throw pybind11::type_error(where + ": " + name + " must be an int, got " + text_of(value));
  const pybind11::object index = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(value.ptr()));
  if (!index) throw pybind11::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0)
    throw pybind11::value_error(where + ": Invalid " + name + " value: " + text_of(value) + " (beyond int64)");
  return v;
}

inline at::Tensor tensor_arg(const std::string& where, const std::string& name, const pybind11::handle& value) {
  if (!THPVariable_Check(value.ptr()))
    throw pybind11::type_error(where + ": " + name + " must be a torch.Tensor, got " + text_of(value));
  return THPVariable_Unpack(value.ptr());
}

/// Tensors from any iterable (list, tuple, generator, module.parameters()); not one tensor, str or dict.
inline std::vector<at::Tensor> tensor_list_arg(const std::string& where, const std::string& name,
                                               const pybind11::handle& value) {
  if (THPVariable_Check(value.ptr()) || pybind11::isinstance<pybind11::str>(value) ||
      pybind11::isinstance<pybind11::dict>(value) || !pybind11::isinstance<pybind11::iterable>(value))
    throw pybind11::type_error(where + ": " + name + " must be an iterable of tensors (a list, or "
                               "module.parameters()), got " + text_of(value));
  std::vector<at::Tensor> out;
  for (const pybind11::handle item : pybind11::reinterpret_borrow<pybind11::iterable>(value))
    out.push_back(tensor_arg(where, name + "[" + std::to_string(out.size()) + "]", item));
  return out;
}

}  // namespace gpuops::python
