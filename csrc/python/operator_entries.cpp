// Direct Python entries for the operators compiled graphs call on every step.
//
// A graph compiled by AOTAutograd (aot_eager, or Inductor's fallback to an
// extern kernel) calls torchleaf::call / forward / backward through their
// OpOverload, whose `_op` is PyTorch's generic boxed entry: it scans every
// argument for __torch_function__ overrides (an isinstance check against
// torch.Tensor per int, ~800 instructions each), converts each argument to
// an IValue by the schema, calls the boxed kernel and converts the stack
// back. For these schemas that is ~17k instructions per call, more than the
// whole C++ kernel around a small body.
//
// These entries do the same call for the arguments such graphs pass (exact
// tensors, ints and lists of them, no keywords, no torch function mode) with
// a typed dispatcher call, or for plain tensors with no tracing mode active
// straight to what the operator's kernels would do (ops::call_plain,
// forward_plain, backward_plain), and hand every other call to the entry
// they replace, so behaviour is PyTorch's own wherever it could differ:
// overriding tensor subclasses and torch function modes (FakeTensor while
// tracing, user modes), keywords, SymInts in the arguments. Dispatch-key
// modes (FakeTensorMode, functionalization, make_fx) see the same operator
// call either way: they run inside the dispatcher.

#include "operator_entries.h"

#include <c10/util/SmallVector.h>

#include <type_traits>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "../ops/leaf_ops.h"
#include "../registry.h"
#include "../torch_private.h"

namespace torchleaf::python {
namespace {

bool exact_int(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) {
    return false;
  }
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(out == -1 && PyErr_Occurred());
}

// Argument lists are parsed into vectors with inline room for a typical
// call: each heap block would be a malloc and a free on every step.
using Tensors = c10::SmallVector<at::Tensor, 8>;
using Ints = c10::SmallVector<int64_t, 16>;

// A list of plain tensors (torch.Tensor or nn.Parameter, whose torch
// function is disabled); into a vector of std::optional<at::Tensor>, None
// entries become nullopt (the `Tensor?[]` of backward's gradients).
template <typename Vector>
bool plain_tensor_list(PyObject* o, Vector& out) {
  constexpr bool allow_none =
      std::is_same_v<typename Vector::value_type, std::optional<at::Tensor>>;
  if (!PyList_CheckExact(o)) {
    return false;
  }
  const auto n = PyList_GET_SIZE(o);
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(o, i);
    if (allow_none && item == Py_None) {
      out.emplace_back();
    } else if (torch_private::is_exact_tensor(item)) {
      out.emplace_back(THPVariable_Unpack(item));
    } else {
      return false;
    }
  }
  return true;
}

bool int_list(PyObject* o, Ints& out) {
  if (!PyList_CheckExact(o)) {
    return false;
  }
  const auto n = PyList_GET_SIZE(o);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!exact_int(PyList_GET_ITEM(o, i), out[i])) {
      return false;
    }
  }
  return true;
}

PyObject* wrap_list(const TensorList& tensors) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(tensors.size()));
  if (list == nullptr) {
    throw python_error();
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* item = THPVariable_Wrap(tensors[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      throw python_error();
    }
    PyList_SET_ITEM(list, i, item);
  }
  return list;
}

// Arguments a direct entry may take: positional, and no torch function mode
// to consult (overriding tensors are refused argument by argument).
bool plain_call(Py_ssize_t nargs, Py_ssize_t expected, PyObject* kwnames) {
  return nargs == expected &&
      (kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0) &&
      !torch_private::torch_function_mode_enabled();
}

// Releases the GIL for the call of a leaf whose real function is C++ (it
// has a named operator; Python leaves without a name do not), as PyTorch's
// own entry does. A Python leaf's call keeps it: its work is the Python
// runner, the user's operators release it as they always do, and tensors
// that had Python objects are dropped without taking it back (a
// re-acquisition per tensor, per argument description).
void release_gil_for_cpp(
    const LeafEntry& entry,
    std::optional<pybind11::gil_scoped_release>& no_gil) {
  if (entry.has_named_op()) {
    no_gil.emplace();
  }
}

PyObject* fallback(
    PyObject* self,
    PyObject* const* args,
    Py_ssize_t nargs,
    PyObject* kwnames) {
  return PyObject_Vectorcall(self, args, static_cast<size_t>(nargs), kwnames);
}

// `self` is the entry replaced: OpOverload._op as PyTorch made it.
PyObject* call_entry(
    PyObject* self,
    PyObject* const* args,
    Py_ssize_t nargs,
    PyObject* kwnames) {
  HANDLE_TH_ERRORS
  int64_t leaf = 0;
  int64_t plan = 0;
  Tensors inputs;
  if (!plain_call(nargs, 3, kwnames) || !exact_int(args[0], leaf) ||
      !exact_int(args[1], plan) || !plain_tensor_list(args[2], inputs)) {
    return fallback(self, args, nargs, kwnames);
  }
  const auto entry = get_leaf(leaf);
  std::optional<pybind11::gil_scoped_release> no_gil;
  release_gil_for_cpp(*entry, no_gil);
  auto plain = ops::call_plain(*entry, plan, inputs);
  TensorList out =
      plain ? std::move(*plain) : ops::call(leaf, plan, inputs, {});
  no_gil.reset();
  return wrap_list(out);
  END_HANDLE_TH_ERRORS
}

PyObject* forward_entry(
    PyObject* self,
    PyObject* const* args,
    Py_ssize_t nargs,
    PyObject* kwnames) {
  HANDLE_TH_ERRORS
  int64_t leaf = 0;
  int64_t plan = 0;
  Tensors inputs;
  Ints differentiable;
  if (!plain_call(nargs, 4, kwnames) || !exact_int(args[0], leaf) ||
      !exact_int(args[1], plan) || !plain_tensor_list(args[2], inputs) ||
      !int_list(args[3], differentiable)) {
    return fallback(self, args, nargs, kwnames);
  }
  auto entry = get_leaf(leaf);
  std::optional<pybind11::gil_scoped_release> no_gil;
  release_gil_for_cpp(*entry, no_gil);
  auto plain =
      ops::forward_plain(std::move(entry), plan, inputs, differentiable);
  auto out = plain ? std::move(*plain)
                   : ops::forward(leaf, plan, inputs, {}, differentiable);
  no_gil.reset();
  PyObject* outputs = wrap_list(std::get<0>(out));
  PyObject* state = THPVariable_Wrap(std::get<1>(out));
  PyObject* result = PyTuple_New(2);
  if (result == nullptr || state == nullptr) {
    Py_XDECREF(outputs);
    Py_XDECREF(state);
    Py_XDECREF(result);
    throw python_error();
  }
  PyTuple_SET_ITEM(result, 0, outputs);
  PyTuple_SET_ITEM(result, 1, state);
  return result;
  END_HANDLE_TH_ERRORS
}

PyObject* backward_entry(
    PyObject* self,
    PyObject* const* args,
    Py_ssize_t nargs,
    PyObject* kwnames) {
  HANDLE_TH_ERRORS
  int64_t leaf = 0;
  std::vector<std::optional<at::Tensor>> grads;
  Ints input_meta;
  if (!plain_call(nargs, 4, kwnames) || !exact_int(args[0], leaf) ||
      !torch_private::is_exact_tensor(args[1]) ||
      !plain_tensor_list(args[2], grads) || !int_list(args[3], input_meta)) {
    return fallback(self, args, nargs, kwnames);
  }
  const at::Tensor& state = THPVariable_Unpack(args[1]);
  TensorList out;
  {
    pybind11::gil_scoped_release no_gil;
    if (auto plain = ops::backward_plain(leaf, state, grads)) {
      out = std::move(*plain);
    } else {
      out = ops::backward(
          leaf,
          state,
          c10::List<std::optional<at::Tensor>>(grads),
          c10::fromIntArrayRefSlow(input_meta));
    }
  }
  return wrap_list(out);
  END_HANDLE_TH_ERRORS
}

PyMethodDef kEntries[] = {
    {"call",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_entry)),
     METH_FASTCALL | METH_KEYWORDS,
     "torchleaf::call, directly (see operator_entries.cpp)."},
    {"forward",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward_entry)),
     METH_FASTCALL | METH_KEYWORDS,
     "torchleaf::forward, directly (see operator_entries.cpp)."},
    {"backward",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(backward_entry)),
     METH_FASTCALL | METH_KEYWORDS,
     "torchleaf::backward, directly (see operator_entries.cpp)."},
};

} // namespace

pybind11::object direct_operator_entry(
    const std::string& name,
    pybind11::object replaced) {
  for (auto& def : kEntries) {
    if (name == def.ml_name) {
      PyObject* entry = PyCFunction_NewEx(&def, replaced.ptr(), nullptr);
      if (entry == nullptr) {
        throw pybind11::error_already_set();
      }
      return pybind11::reinterpret_steal<pybind11::object>(entry);
    }
  }
  throw pybind11::value_error(
      "torchleaf has no direct entry for operator '" + name + "'");
}

} // namespace torchleaf::python
