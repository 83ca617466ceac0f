#pragma once

// Plumbing for torchleaf._C's raw METH_FASTCALL functions (module_entries.cpp,
// module_call.cpp): called on every step, where pybind11's argument
// conversion would cost more than the work.

#include <iterator>

#include <torch/csrc/utils/pybind.h>

namespace torchleaf::python {

// Casts a METH_FASTCALL function for a PyMethodDef.
template <typename Function>
PyCFunction fastcall(Function function) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function));
}

// False with a TypeError set when `nargs` is not `expected`.
inline bool check_arity(
    const char* name,
    Py_ssize_t nargs,
    Py_ssize_t expected) {
  if (nargs == expected) {
    return true;
  }
  PyErr_Format(
      PyExc_TypeError,
      "torchleaf._C.%s takes %zd arguments (%zd given)",
      name,
      expected,
      nargs);
  return false;
}

// Adds each function of `table` (static storage: Python keeps pointers to
// its entries) to `m` under its name.
template <size_t N>
void add_functions(pybind11::module_& m, PyMethodDef (&table)[N]) {
  for (PyMethodDef& def : table) {
    PyObject* function =
        PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr());
    if (function == nullptr) {
      throw pybind11::error_already_set();
    }
    m.add_object(
        def.ml_name, pybind11::reinterpret_steal<pybind11::object>(function));
  }
}

} // namespace torchleaf::python
