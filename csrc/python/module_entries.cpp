// The per-call dict work of module arguments, at C speed.
//
// A call with a module argument runs the function with the module's
// parameters and buffers replaced by the call's tensors (_modules._Binder):
// it checks that the module still is what its last walk saw (every dict and
// entry the same object, no entry added), writes the call's tensors into the
// dicts that hold the module's, puts the originals back afterwards, and
// compares the tensors' versions. Python decides what to check and where to
// write (_modules.ModuleView); these functions only do the loops. Written in
// Python with map() and all(), the loops cost ~13 us of a ~30 us compiled call
// of a one-Linear block, and 0.5 us per parameter of a large module.
//
// Raw METH_FASTCALL functions, as operator_entries.cpp's: pybind11's argument
// conversion would cost more than the loops.

#include "module_entries.h"

#include "../checks.h"
#include "fastcall.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace torchleaf::python {
namespace {

// Checked by the Python caller's construction (ModuleView), asserted here
// cheaply: lists of equal length.
bool lists(PyObject* const* args, Py_ssize_t n, Py_ssize_t& size) {
  size = -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyList_CheckExact(args[i])) {
      PyErr_SetString(PyExc_TypeError, "torchleaf: expected lists");
      return false;
    }
    const Py_ssize_t len = PyList_GET_SIZE(args[i]);
    if (size != -1 && len != size) {
      PyErr_SetString(PyExc_ValueError, "torchleaf: lists of unequal length");
      return false;
    }
    size = len;
  }
  return true;
}

// dict[key] as a borrowed reference, nullptr when missing or not a dict (an
// error set only for a failing __hash__/__eq__ of the key).
PyObject* entry(PyObject* dict, PyObject* key) {
  if (!PyDict_Check(dict)) {
    return nullptr;
  }
  return PyDict_GetItemWithError(dict, key);
}

// Whether `dict` holds exactly `items` ([key0, value0, key1, ...], the same
// objects in the same order). One pass over the dict's entries, where a
// lookup per key would hash and probe: a module argument's dicts hold every
// parameter, checked before and after each call. A key deleted and put back
// with an equal new object reads as a change (the caller then walks the module
// again).
bool holds_in_order(PyObject* dict, PyObject* items) {
  if (!PyDict_Check(dict) || !PyList_CheckExact(items) ||
      PyDict_GET_SIZE(dict) * 2 != PyList_GET_SIZE(items)) {
    return false;
  }
  Py_ssize_t pos = 0;
  Py_ssize_t i = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (key != PyList_GET_ITEM(items, i) ||
        value != PyList_GET_ITEM(items, i + 1)) {
      return false;
    }
    i += 2;
  }
  return true;
}

} // namespace

int same_entries(
    PyObject* root,
    PyObject* dicts,
    PyObject* keys,
    PyObject* values,
    PyObject* whole,
    PyObject* contents) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* dict = PyList_GET_ITEM(dicts, i);
    PyObject* found =
        entry(dict == Py_None ? root : dict, PyList_GET_ITEM(keys, i));
    if (found != PyList_GET_ITEM(values, i)) {
      return PyErr_Occurred() ? -1 : 0;
    }
  }
  const Py_ssize_t n_whole = PyList_GET_SIZE(whole);
  for (Py_ssize_t i = 0; i < n_whole; ++i) {
    if (!holds_in_order(
            PyList_GET_ITEM(whole, i), PyList_GET_ITEM(contents, i))) {
      return 0;
    }
  }
  return 1;
}

PyObject* swap_entries(
    PyObject* dicts,
    PyObject* keys,
    PyObject* values,
    PyObject* current) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts);
  PyObject* old = PyList_New(n);
  if (old == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* dict = PyList_GET_ITEM(dicts, i);
    PyObject* key = PyList_GET_ITEM(keys, i);
    if (PyList_GET_ITEM(values, i) == PyList_GET_ITEM(current, i)) {
      // The entry already holds the value (a parameter the function gets
      // as it is): two dict operations saved per tensor.
      PyObject* same = PyList_GET_ITEM(values, i);
      Py_INCREF(same);
      PyList_SET_ITEM(old, i, same);
      continue;
    }
    PyObject* found = entry(dict, key);
    if (found == nullptr) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_KeyError, "torchleaf: a module entry is missing");
      }
    } else {
      Py_INCREF(found);
      PyList_SET_ITEM(old, i, found);
      if (PyDict_SetItem(dict, key, PyList_GET_ITEM(values, i)) == 0) {
        continue;
      }
    }
    // Undo what was written: the module keeps its own tensors.
    for (Py_ssize_t j = 0; j < i; ++j) {
      PyDict_SetItem(
          PyList_GET_ITEM(dicts, j),
          PyList_GET_ITEM(keys, j),
          PyList_GET_ITEM(old, j));
    }
    Py_DECREF(old);
    return nullptr;
  }
  return old;
}

Py_ssize_t restore_entries(
    PyObject* dicts,
    PyObject* keys,
    PyObject* old,
    PyObject* expected) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts);
  Py_ssize_t first_replaced = -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_ITEM(old, i) == PyList_GET_ITEM(expected, i)) {
      continue;
    }
    PyObject* dict = PyList_GET_ITEM(dicts, i);
    PyObject* key = PyList_GET_ITEM(keys, i);
    if (first_replaced == -1 &&
        entry(dict, key) != PyList_GET_ITEM(expected, i)) {
      PyErr_Clear(); // (a failing lookup counts as replaced)
      first_replaced = i;
    }
    if (!PyDict_Check(dict) ||
        PyDict_SetItem(dict, key, PyList_GET_ITEM(old, i)) != 0) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "torchleaf: expected dicts");
      }
      return -2;
    }
  }
  return first_replaced;
}

namespace {

// same_entries(root, dicts, keys, values, whole, contents) -> bool
PyObject* same_entries_entry(
    PyObject*,
    PyObject* const* args,
    Py_ssize_t nargs) {
  if (!check_arity("same_entries", nargs, 6)) {
    return nullptr;
  }
  Py_ssize_t n = 0;
  Py_ssize_t n_whole = 0;
  if (!lists(args + 1, 3, n) || !lists(args + 4, 2, n_whole)) {
    return nullptr;
  }
  const int same =
      same_entries(args[0], args[1], args[2], args[3], args[4], args[5]);
  if (same < 0) {
    return nullptr;
  }
  return PyBool_FromLong(same);
}

// swap_entries(dicts, keys, values, current) -> list of the entries replaced
PyObject* swap_entries_entry(
    PyObject*,
    PyObject* const* args,
    Py_ssize_t nargs) {
  Py_ssize_t n = 0;
  if (!check_arity("swap_entries", nargs, 4) || !lists(args, 4, n)) {
    return nullptr;
  }
  return swap_entries(args[0], args[1], args[2], args[3]);
}

// restore_entries(dicts, keys, old, expected) -> index of the first entry
// that did not hold expected[i] (-1 if all did)
PyObject* restore_entries_entry(
    PyObject*,
    PyObject* const* args,
    Py_ssize_t nargs) {
  Py_ssize_t n = 0;
  if (!check_arity("restore_entries", nargs, 4) || !lists(args, 4, n)) {
    return nullptr;
  }
  const Py_ssize_t replaced =
      restore_entries(args[0], args[1], args[2], args[3]);
  return replaced == -2 ? nullptr : PyLong_FromSsize_t(replaced);
}

// tensor_versions(tensors) -> list of each tensor's version counter (None
// for an inference tensor, which has none).
PyObject* tensor_versions(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_arity("tensor_versions", nargs, 1)) {
    return nullptr;
  }
  Py_ssize_t n = 0;
  if (!lists(args, 1, n)) {
    return nullptr;
  }
  auto out = pybind11::reinterpret_steal<pybind11::object>(PyList_New(n));
  if (!out) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(args[0], i);
    if (!THPVariable_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "torchleaf: expected tensors");
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(item);
    PyObject* version = nullptr;
    if (t.is_inference()) {
      Py_INCREF(Py_None);
      version = Py_None;
    } else {
      version = PyLong_FromUnsignedLongLong(version_of(t));
    }
    if (version == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(out.ptr(), i, version);
  }
  return out.release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef kFunctions[] = {
    {"same_entries",
     fastcall(same_entries_entry),
     METH_FASTCALL,
     "same_entries(root, dicts, keys, values, whole, contents) -> bool: "
     "whether each dicts[i] (root where it is None) maps keys[i] to exactly "
     "values[i] (identity), and each whole[j] holds exactly the items "
     "contents[j] lists ([key0, value0, key1, ...], identity, in order)."},
    {"swap_entries",
     fastcall(swap_entries_entry),
     METH_FASTCALL,
     "swap_entries(dicts, keys, values, current) -> list: set "
     "dicts[i][keys[i]] = values[i] and return the entries replaced "
     "(KeyError, nothing changed, when one is missing); an entry whose value "
     "is current[i] (what the entries hold) is left alone."},
    {"restore_entries",
     fastcall(restore_entries_entry),
     METH_FASTCALL,
     "restore_entries(dicts, keys, old, expected) -> int: set every "
     "dicts[i][keys[i]] back to old[i]; return the index of the first entry "
     "that did not hold expected[i] before, or -1. Entries where old[i] is "
     "expected[i] (swap_entries left them alone) are skipped."},
    {"tensor_versions",
     fastcall(tensor_versions),
     METH_FASTCALL,
     "tensor_versions(tensors) -> list: each tensor's version counter (None "
     "for an inference tensor)."},
};

} // namespace

void add_module_entry_functions(pybind11::module_& m) {
  add_functions(m, kFunctions);
}

} // namespace torchleaf::python
