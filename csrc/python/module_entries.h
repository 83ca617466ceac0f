#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torchleaf::python {

// Adds the per-call dict-entry functions of module arguments to `m`
// (same_entries, swap_entries, restore_entries, tensor_versions). See
// module_entries.cpp.
void add_module_entry_functions(pybind11::module_& m);

// The loops behind those functions, for C++ callers (module_call.cpp). The
// GIL is held; the arguments are lists of equal length (unchecked). See the
// Python functions' documentation in _C.pyi for what each does.

// 1 if the module's entries are as listed, 0 if not, -1 with a Python error
// set (a key whose __eq__ failed).
int same_entries(
    PyObject* root,
    PyObject* dicts,
    PyObject* keys,
    PyObject* values,
    PyObject* whole,
    PyObject* contents);

// A new list of the entries replaced, or nullptr with a Python error set
// (nothing changed then).
PyObject* swap_entries(
    PyObject* dicts,
    PyObject* keys,
    PyObject* values,
    PyObject* current);

// The index of the first entry that did not hold expected[i] (-1 if all
// did), or -2 with a Python error set.
Py_ssize_t restore_entries(
    PyObject* dicts,
    PyObject* keys,
    PyObject* old,
    PyObject* expected);

} // namespace torchleaf::python
