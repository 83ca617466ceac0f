// The common call of a Python leaf with a module argument, in one C
// function: a layer's leaf(block, x), run on every training step.
//
// A compiled graph passes the block's tensors, not the block (a handle would
// make Dynamo guard each graph on one module). call_found_module finds the
// module by its first tensor's data in _module_index's table and checks that
// it is still what its latest walk (_modules.ModuleView) saw; an eager call
// has its module and view, checked moments ago, and enters at
// call_bound_module. Either then puts the call's tensors in the module's
// dicts, runs the function and puts the module's own back. In Python that
// was eight frames around the function (Plan.rebuild_one_module,
// _module_index.find, ModuleView.unchanged twice, call_with_module,
// _Binder's __init__, enter, exit and check): ~36k instructions per
// compiled call, a sixth of a small block's whole forward; ~19k now.
//
// Only the case that needs no decision is done here: exactly one module
// filed under the address, unchanged, a view of the plan's structure (the
// same interned object) that places the tensors by slot. Anything else
// returns NotImplemented before touching anything, and the caller takes the
// Python path, which searches, walks again or binds by name. After the
// function ran, a name of the structure that may no longer lead to its
// slot's tensor (an entry replaced, a submodule or a dict reassigned: the
// view's after_call_check) or a tensor changed in place goes to the Python
// `finish` callback (_modules.finish_found_call: _Binder's exit and check),
// which restores what is needed and raises the error that names the
// argument.
//
// No state is kept between calls: the functions read the view's fields on
// each call and hold no reference after they return.

#include "module_call.h"

#include <c10/util/SmallVector.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "../checks.h"
#include "../torch_private.h"
#include "fastcall.h"
#include "module_entries.h"

namespace torchleaf::python {
namespace {

using Object = pybind11::object;

// The attribute names the call reads, interned once (PyObject_GetAttrString
// would decode and hash each name on every call).
PyObject* name(const char* text) {
  PyObject* interned = PyUnicode_InternFromString(text);
  TORCH_INTERNAL_ASSERT(interned != nullptr);
  return interned; // (immortal: kept for the process)
}

Object steal(PyObject* o) {
  if (o == nullptr) {
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<Object>(o);
}

// The names, made on first use (the GIL held).
struct Names {
  PyObject* const structure = name("structure");
  PyObject* const tensors = name("tensors");
  PyObject* const check_dicts = name("check_dicts");
  PyObject* const check_keys = name("check_keys");
  PyObject* const check_values = name("check_values");
  PyObject* const dicts = name("dicts");
  PyObject* const contents = name("contents");
  PyObject* const slot_dicts = name("slot_dicts");
  PyObject* const slot_keys = name("slot_keys");
  PyObject* const slot_tensors = name("slot_tensors");
  PyObject* const slots_in_order = name("slots_in_order");
  PyObject* const slot_index = name("slot_index");
  PyObject* const after_call_check = name("after_call_check");
  PyObject* const ref = name("ref"); // (an index entry's)
  PyObject* const view = name("view");
  PyObject* const dict = name("__dict__");
  PyObject* const acquire = name("acquire");
  PyObject* const release = name("release");
};

const Names& names() {
  static const Names interned;
  return interned;
}

// The fields of a _modules.ModuleView that the call reads, by name (the
// view is a __slots__ class: each read is a type lookup and a slot load).
struct ViewFields {
  Object structure, tensors, check_dicts, check_keys, check_values, dicts,
      contents, slot_dicts, slot_keys, slot_tensors, slots_in_order, slot_index,
      after_call_check;

  explicit ViewFields(PyObject* view)
      : structure(read(view, names().structure)),
        tensors(read(view, names().tensors)),
        check_dicts(read(view, names().check_dicts)),
        check_keys(read(view, names().check_keys)),
        check_values(read(view, names().check_values)),
        dicts(read(view, names().dicts)),
        contents(read(view, names().contents)),
        slot_dicts(read(view, names().slot_dicts)) {
    if (!slot_dicts.is_none()) {
      slot_keys = read(view, names().slot_keys);
      slot_tensors = read(view, names().slot_tensors);
      slots_in_order = read(view, names().slots_in_order);
      slot_index = read(view, names().slot_index);
      after_call_check = read(view, names().after_call_check);
    }
  }

  // Whether the module's entries are those the walk saw (the full check).
  bool unchanged(PyObject* module_dict) const {
    const int same = compare(module_dict);
    if (same < 0) {
      throw pybind11::error_already_set();
    }
    return same == 1;
  }

  // After the function ran, with the slots restored: whether every name of
  // the structure still leads to its slot (the view's after_call_check).
  bool names_lead_to_slots(PyObject* module_dict) const {
    const int same = compare_after_call(module_dict);
    if (same < 0) {
      throw pybind11::error_already_set();
    }
    return same == 1;
  }

  // names_lead_to_slots() for a caller with an exception pending: a failing
  // comparison reads as a change.
  bool names_lead_to_slots_or_error(PyObject* module_dict) const {
    const int same = compare_after_call(module_dict);
    if (same < 0) {
      PyErr_Clear();
    }
    return same == 1;
  }

  // Whether the view can run a call here: its tensors go to slots, its
  // structure is the plan's (the same interned object), it has `width`
  // tensors, and its lists are as ModuleView makes them (checked, not
  // assumed: the loops index them without bounds checks).
  bool runs_here(PyObject* plan_structure, Py_ssize_t width) const {
    if (slot_dicts.is_none() || structure.ptr() != plan_structure) {
      return false;
    }
    for (const Object* list :
         {&tensors,
          &check_dicts,
          &check_keys,
          &check_values,
          &dicts,
          &contents,
          &slot_dicts,
          &slot_keys,
          &slot_tensors,
          &slot_index}) {
      if (!PyList_CheckExact(list->ptr())) {
        return false;
      }
    }
    const Py_ssize_t n_slots = size(slot_dicts);
    return after_call_check_usable() && size(tensors) == width &&
        size(check_keys) == size(check_dicts) &&
        size(check_values) == size(check_dicts) &&
        size(contents) == size(dicts) && size(slot_keys) == n_slots &&
        size(slot_tensors) == n_slots && size(slot_index) == n_slots &&
        (!in_order() || n_slots == width);
  }

  bool in_order() const {
    return slots_in_order.ptr() == Py_True;
  }

 private:
  int compare(PyObject* module_dict) const {
    return same_entries(
        module_dict,
        check_dicts.ptr(),
        check_keys.ptr(),
        check_values.ptr(),
        dicts.ptr(),
        contents.ptr());
  }

  // (After runs_here(): a tuple of five lists, as ModuleView makes it.)
  int compare_after_call(PyObject* module_dict) const {
    PyObject* const* part = after_call_parts();
    return same_entries(
        module_dict, part[0], part[1], part[2], part[3], part[4]);
  }

  PyObject* const* after_call_parts() const {
    return &PyTuple_GET_ITEM(after_call_check.ptr(), 0);
  }

  // Whether after_call_check is same_entries' arguments: (dicts, keys,
  // values) of one length, (whole, contents) of another.
  bool after_call_check_usable() const {
    PyObject* check = after_call_check.ptr();
    if (!PyTuple_CheckExact(check) || PyTuple_GET_SIZE(check) != 5) {
      return false;
    }
    PyObject* const* part = after_call_parts();
    for (int i = 0; i < 5; ++i) {
      if (!PyList_CheckExact(part[i])) {
        return false;
      }
    }
    return PyList_GET_SIZE(part[1]) == PyList_GET_SIZE(part[0]) &&
        PyList_GET_SIZE(part[2]) == PyList_GET_SIZE(part[0]) &&
        PyList_GET_SIZE(part[4]) == PyList_GET_SIZE(part[3]);
  }

  static Py_ssize_t size(const Object& list) {
    return PyList_GET_SIZE(list.ptr());
  }

  static Object read(PyObject* view, PyObject* name) {
    return steal(PyObject_GetAttr(view, name));
  }
};

// The address of a plain tensor's data (what Python's data_ptr() gives and
// the index is keyed by); 0 for anything else: a subclass, no storage.
intptr_t data_address(PyObject* item) {
  if (!torch_private::is_exact_tensor(item)) {
    return 0;
  }
  const at::Tensor& t = THPVariable_Unpack(item);
  if (!t.has_storage()) {
    return 0;
  }
  try {
    return reinterpret_cast<intptr_t>(t.const_data_ptr());
  } catch (const c10::Error&) { // (storage access refused: functional tensors)
    return 0;
  }
}

// A tensor's version, -1 for an inference tensor (it has none).
int64_t version_of(PyObject* item) {
  const at::Tensor& t = THPVariable_Unpack(item);
  return t.is_inference() ? -1 : static_cast<int64_t>(torchleaf::version_of(t));
}

Object versions_list(const c10::SmallVector<int64_t, 8>& versions) {
  Object out = steal(PyList_New(static_cast<Py_ssize_t>(versions.size())));
  for (size_t i = 0; i < versions.size(); ++i) {
    PyObject* v = versions[i] < 0 ? (Py_INCREF(Py_None), Py_None)
                                  : PyLong_FromLongLong(versions[i]);
    if (v == nullptr) {
      throw pybind11::error_already_set();
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

// Holds a threading.RLock for a scope.
class LockHeld {
 public:
  explicit LockHeld(PyObject* lock) : lock_(lock) {
    steal(PyObject_CallMethodNoArgs(lock_, names().acquire));
  }
  LockHeld(const LockHeld&) = delete;
  LockHeld& operator=(const LockHeld&) = delete;
  // Releases with any pending exception put aside.
  ~LockHeld() {
    pybind11::error_scope pending;
    PyObject* done = PyObject_CallMethodNoArgs(lock_, names().release);
    if (done == nullptr) {
      PyErr_WriteUnraisable(lock_);
    }
    Py_XDECREF(done);
  }

 private:
  PyObject* lock_;
};

// What the functions return when the call is not theirs to make (before any
// side effect): the caller takes the Python path.
PyObject* not_here() {
  Py_RETURN_NOTIMPLEMENTED;
}

// What a call needs once its module is bound: the function and its
// arguments (borrowed), the module, its view and the view's fields, the
// call's tensors for the module (`own`, in the order of the view's tensors),
// and what the error path needs.
struct BoundCall {
  PyObject* fn;
  PyObject* const* args;
  Py_ssize_t n_args;
  PyObject* module;
  PyObject* module_dict;
  PyObject* view;
  const ViewFields& fields;
  PyObject* own;
  PyObject* structure;
  PyObject* lock;
  PyObject* finish;
  PyObject* leaf;
};

// Runs the function with the module's slots holding the call's tensors
// (_modules._Binder's enter, the call, exit and check).
PyObject* run_bound(const BoundCall& call) {
  const ViewFields& fields = call.fields;
  const Py_ssize_t width = PyList_GET_SIZE(call.own);
  c10::SmallVector<int64_t, 8> versions;
  versions.reserve(width);
  for (Py_ssize_t i = 0; i < width; ++i) {
    PyObject* item = PyList_GET_ITEM(call.own, i);
    if (!THPVariable_Check(item)) {
      return not_here();
    }
    versions.push_back(version_of(item));
  }
  Object fresh; // the call's tensors in slot order
  if (fields.in_order()) {
    fresh = pybind11::reinterpret_borrow<Object>(call.own);
  } else {
    const Py_ssize_t n = PyList_GET_SIZE(fields.slot_index.ptr());
    fresh = steal(PyList_New(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const Py_ssize_t k =
          PyLong_AsSsize_t(PyList_GET_ITEM(fields.slot_index.ptr(), i));
      TORCH_INTERNAL_ASSERT(0 <= k && k < width);
      PyObject* item = PyList_GET_ITEM(call.own, k);
      Py_INCREF(item);
      PyList_SET_ITEM(fresh.ptr(), i, item);
    }
  }

  PyObject* out = nullptr;
  Object old;
  Py_ssize_t replaced = -1;
  bool finish_failed = false; // the function raised and changed the module
  {
    // The call's tensors are the module's while the function runs: no other
    // thread's call may read or swap them meanwhile (_modules.modules_lock).
    LockHeld held(call.lock);
    old = steal(swap_entries(
        fields.slot_dicts.ptr(),
        fields.slot_keys.ptr(),
        fresh.ptr(),
        fields.slot_tensors.ptr()));
    out = PyObject_Vectorcall(
        call.fn, call.args, static_cast<size_t>(call.n_args), nullptr);
    pybind11::error_scope pending; // (the function's exception, if any)
    replaced = restore_entries(
        fields.slot_dicts.ptr(),
        fields.slot_keys.ptr(),
        old.ptr(),
        fresh.ptr());
    if (replaced == -2) { // (a slot's dict is no dict any more)
      PyErr_Clear();
      replaced = 0;
    }
    finish_failed = out == nullptr &&
        (replaced >= 0 ||
         !fields.names_lead_to_slots_or_error(call.module_dict));
  }
  auto call_finish = [&](PyObject* failed) {
    Object replaced_object = steal(PyLong_FromSsize_t(replaced));
    Object versions_object = versions_list(versions);
    PyObject* finish_args[] = {
        call.leaf,
        call.module,
        call.structure,
        call.own,
        call.view,
        old.ptr(),
        fresh.ptr(),
        replaced_object.ptr(),
        versions_object.ptr(),
        failed};
    steal(PyObject_Vectorcall(call.finish, finish_args, 10, nullptr));
  };
  if (out == nullptr) {
    if (finish_failed) {
      // finish restores what the function changed (as _Binder.exit does);
      // the function's exception is what the caller sees.
      pybind11::error_scope pending;
      try {
        call_finish(Py_True);
      } catch (pybind11::error_already_set& e) {
        e.discard_as_unraisable(
            pybind11::reinterpret_borrow<Object>(call.finish));
      }
    }
    return nullptr;
  }
  Object result = steal(out);
  bool as_it_was = replaced < 0 && fields.names_lead_to_slots(call.module_dict);
  for (Py_ssize_t i = 0; as_it_was && i < width; ++i) {
    as_it_was = version_of(PyList_GET_ITEM(call.own, i)) == versions[i];
  }
  if (!as_it_was) {
    call_finish(Py_False);
  }
  return result.release().ptr();
}

// call_found_module(fn, tensors, template, position, start, stop,
//                   tensor_places, structure, index, lock, finish, leaf)
PyObject* call_found_module(
    PyObject*,
    PyObject* const* args,
    Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_arity("call_found_module", nargs, 12)) {
    return nullptr;
  }
  PyObject* fn = args[0];
  PyObject* tensors = args[1];
  PyObject* template_ = args[2];
  const Py_ssize_t position = PyLong_AsSsize_t(args[3]);
  const Py_ssize_t start = PyLong_AsSsize_t(args[4]);
  const Py_ssize_t stop = PyLong_AsSsize_t(args[5]);
  PyObject* tensor_places = args[6];
  PyObject* structure = args[7];
  PyObject* index = args[8];
  if (PyErr_Occurred()) {
    return nullptr;
  }
  TORCH_INTERNAL_ASSERT(
      PyList_CheckExact(tensors) && PyTuple_CheckExact(template_) &&
      PyTuple_CheckExact(tensor_places) && PyDict_CheckExact(index));
  const Py_ssize_t n_tensors = PyList_GET_SIZE(tensors);
  const Py_ssize_t n_args = PyTuple_GET_SIZE(template_);
  TORCH_INTERNAL_ASSERT(
      0 <= start && start < stop && stop <= n_tensors && 0 <= position &&
      position < n_args);

  // The module: the one filed under its first tensor's address.
  const intptr_t key = data_address(PyList_GET_ITEM(tensors, start));
  if (key == 0) {
    return not_here();
  }
  Object key_object = steal(PyLong_FromSsize_t(key));
  PyObject* entries = PyDict_GetItemWithError(index, key_object.ptr());
  if (entries == nullptr) {
    return PyErr_Occurred() ? nullptr : not_here();
  }
  if (!PyList_CheckExact(entries) || PyList_GET_SIZE(entries) != 1) {
    return not_here();
  }
  // (Held: a collection while the lookup runs could drop the module and,
  // by its weak reference's callback, the entry from the list.)
  const Object entry =
      pybind11::reinterpret_borrow<Object>(PyList_GET_ITEM(entries, 0));
  Object ref = steal(PyObject_GetAttr(entry.ptr(), names().ref));
  Object module = steal(PyObject_CallNoArgs(ref.ptr()));
  if (module.is_none()) {
    return not_here();
  }
  Object view = steal(PyObject_GetAttr(entry.ptr(), names().view));
  const ViewFields fields(view.ptr());
  const Py_ssize_t width = stop - start;
  if (!fields.runs_here(structure, width)) {
    return not_here();
  }
  Object module_dict = steal(PyObject_GetAttr(module.ptr(), names().dict));
  // (The last tensor too: a module that ties only its first tensor to this
  // one's, a shared embedding, is another.)
  const intptr_t last = data_address(PyList_GET_ITEM(tensors, stop - 1));
  if (data_address(PyList_GET_ITEM(fields.tensors.ptr(), 0)) != key ||
      last == 0 ||
      data_address(PyList_GET_ITEM(fields.tensors.ptr(), width - 1)) != last ||
      !fields.unchanged(module_dict.ptr())) {
    return not_here();
  }

  // The function's arguments: the plan's template with the module and the
  // call's tensors in their places (borrowed: the tuple and list hold them).
  c10::SmallVector<PyObject*, 8> call_args(
      &PyTuple_GET_ITEM(template_, 0),
      &PyTuple_GET_ITEM(template_, 0) + n_args);
  call_args[position] = module.ptr();
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensor_places); ++i) {
    PyObject* place = PyTuple_GET_ITEM(tensor_places, i);
    const Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(place, 0));
    const Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(place, 1));
    TORCH_INTERNAL_ASSERT(0 <= p && p < n_args && 0 <= k && k < n_tensors);
    call_args[p] = PyList_GET_ITEM(tensors, k);
  }
  Object own = steal(PyList_GetSlice(tensors, start, stop));
  return run_bound(BoundCall{
      fn,
      call_args.data(),
      n_args,
      module.ptr(),
      module_dict.ptr(),
      view.ptr(),
      fields,
      own.ptr(),
      structure,
      /*lock=*/args[9],
      /*finish=*/args[10],
      /*leaf=*/args[11]});
  END_HANDLE_TH_ERRORS
}

// call_bound_module(fn, args, module, view, own, structure, lock, finish,
//                   leaf)
PyObject* call_bound_module(
    PyObject*,
    PyObject* const* args,
    Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_arity("call_bound_module", nargs, 9)) {
    return nullptr;
  }
  PyObject* call_args = args[1];
  PyObject* module = args[2];
  PyObject* view = args[3];
  PyObject* own = args[4];
  PyObject* structure = args[5];
  TORCH_INTERNAL_ASSERT(PyList_CheckExact(call_args) && PyList_CheckExact(own));
  const ViewFields fields(view);
  if (!fields.runs_here(structure, PyList_GET_SIZE(own))) {
    return not_here();
  }
  Object module_dict = steal(PyObject_GetAttr(module, names().dict));
  return run_bound(BoundCall{
      /*fn=*/args[0],
      &PyList_GET_ITEM(call_args, 0),
      PyList_GET_SIZE(call_args),
      module,
      module_dict.ptr(),
      view,
      fields,
      own,
      structure,
      /*lock=*/args[6],
      /*finish=*/args[7],
      /*leaf=*/args[8]});
  END_HANDLE_TH_ERRORS
}

PyMethodDef kFunctions[] = {
    {"call_found_module",
     fastcall(call_found_module),
     METH_FASTCALL,
     "call_found_module(fn, tensors, template, position, start, stop, "
     "tensor_places, structure, index, lock, finish, leaf) -> the function's "
     "output, or NotImplemented (nothing done): a compiled one-module call "
     "(see csrc/python/module_call.cpp and _C.pyi)."},
    {"call_bound_module",
     fastcall(call_bound_module),
     METH_FASTCALL,
     "call_bound_module(fn, args, module, view, own, structure, lock, "
     "finish, leaf) -> the function's output, or NotImplemented (nothing "
     "done): a call with one module whose view was checked moments ago "
     "(see csrc/python/module_call.cpp and _C.pyi)."},
};

} // namespace

void add_module_call(pybind11::module_& m) {
  add_functions(m, kFunctions);
}

} // namespace torchleaf::python
