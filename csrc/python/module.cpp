// torchleaf._C: thin pybind11 bindings over the C++ core. Python leaf
// functions become core leaves whose real and fake functions are trampolines
// into Python; everything else (operators, capture, replay, checks, state
// lifetimes) is the core's.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/EmptyTensor.h>
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif
#include <c10/core/DeviceType.h>

#include <torchleaf/torchleaf.h>

#include "../ops/bound_named_ops.h"
#include "../ops/leaf_ops.h"
#include "../registry.h"
#include "../state.h"
#include "../torch_private.h"
#include "module_call.h"
#include "module_entries.h"
#include "operator_entries.h"

namespace py = pybind11;

namespace torchleaf::python {
namespace {

// ------------------------------------------------------------------ errors

PyObject* g_leaf_error_type = nullptr; // torchleaf.LeafFunctionError

// Surfaces as torchleaf.LeafFunctionError wherever torch converts C++
// exceptions (torch.ops calls, the autograd engine, our own bindings).
struct PyLeafError : public torch::PyTorchError {
  using torch::PyTorchError::PyTorchError;
  PyObject* python_type() override {
    return g_leaf_error_type != nullptr ? g_leaf_error_type
                                        : PyExc_RuntimeError;
  }
};

[[noreturn]] void throw_python_leaf_error(const std::string& message) {
  throw PyLeafError(message);
}

// A Python exception thrown through the core (called inside its catch
// block): add `note` to it once, as torchleaf._errors.add_note does for
// real functions (the same two lines, here: no lookup of Python by name).
void note_python_error(const std::string& note) {
  try {
    throw;
  } catch (python_error& e) {
    if (e.value == nullptr || !Py_IsInitialized()) {
      return;
    }
    py::gil_scoped_acquire gil;
    // Python's error indicator may be set too (an engine that ran the
    // failing node restored it): calling Python with it set fails, so it is
    // put aside while the note is added, and restored after.
    py::error_scope pending;
    PyErr_NormalizeException(&e.type, &e.value, &e.traceback);
    try {
      py::handle value(e.value);
      py::object notes = py::getattr(value, "__notes__", py::tuple());
      if (!notes.contains(note) && py::hasattr(value, "add_note")) {
        value.attr("add_note")(note);
      }
    } catch (py::error_already_set&) {
      // Leave the original exception as it is.
    }
  } catch (...) {
  }
}

// ------------------------------------------------------------ Python leaves

// Owns Python references; released with the GIL held, from whichever thread
// drops the last reference (the autograd engine's, for instance).
struct PyRef {
  explicit PyRef(PyObject* o) : obj(o) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyObject* obj;
  ~PyRef() {
    if (obj != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(obj);
    }
  }
};

std::shared_ptr<void> hold(py::object o) {
  auto ref = std::make_shared<PyRef>(o.release().ptr());
  return std::shared_ptr<void>(
      ref, ref->obj); // aliases: get() is the PyObject*
}

// A Python leaf, as the core calls it. `runner(leaf_ref, plan, tensors,
// arguments)` runs the user's function and returns (tensors, output
// description); `fake_runner(leaf_ref, plan, tensors, arguments, real_desc)`
// runs its fake and returns tensors; `input_namer(leaf_ref, plan, index)`
// names an input for an error message (LeafEntry::input_name). `leaf_ref` is
// a weak reference to the Python LeafFunction: the core holds no user object.
struct PythonLeaf {
  std::shared_ptr<void> runner;
  std::shared_ptr<void> fake_runner;
  std::shared_ptr<void> leaf_ref;
  std::shared_ptr<void> input_namer; // may hold None
};

PyObject* ptr(const std::shared_ptr<void>& held) {
  return static_cast<PyObject*>(held.get());
}

// `held`, if given, gets each tensor whose PyObject something besides
// `result` holds (CallSite::outputs_held).
TensorList unpack_tensors(
    const py::handle& result,
    const std::string& leaf,
    const char* what,
    c10::SmallVector<const c10::TensorImpl*, 4>* held = nullptr) {
  TensorList out;
  if (!PyList_Check(result.ptr())) {
    detail::throw_leaf_error(
        leaf, std::string(what) + " runner must return a list of tensors");
  }
  const auto n = PyList_GET_SIZE(result.ptr());
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(result.ptr(), i);
    if (item == Py_None && i == n - 1) {
      // A compiled call's new order token (see _leaf._run_real): an empty
      // CPU tensor, made directly (no dispatch: nothing intercepts it).
      out.push_back(at::detail::empty_cpu({0}, at::kLong));
      continue;
    }
    if (!THPVariable_Check(item)) {
      detail::throw_leaf_error(
          leaf,
          std::string(what) + " function returned a " + Py_TYPE(item)->tp_name +
              " where a tensor was expected");
    }
    // Held when it has references besides the list's. Read before the
    // tensor gains a C++ reference below: PyTorch then keeps its PyObject
    // alive with one of its own. A tensor the list holds twice is judged at
    // its first place (later, the C++ reference counts); the core copies its
    // second place as an alias.
    bool held_elsewhere = false;
    if (Py_REFCNT(item) > 1) {
      Py_ssize_t in_list = 0;
      bool first_place = true;
      for (Py_ssize_t j = 0; j < n; ++j) {
        if (PyList_GET_ITEM(result.ptr(), j) == item) {
          first_place = first_place && j >= i;
          ++in_list;
        }
      }
      held_elsewhere = first_place && Py_REFCNT(item) > in_list;
    }
    out.push_back(THPVariable_Unpack(item));
    if (held != nullptr && held_elsewhere) {
      held->push_back(out.back().unsafeGetTensorImpl());
    }
  }
  return out;
}

// A list (or tuple) of tensors from Python, as pybind11's list caster
// would convert it, without its per-item cost (a sequence protocol call, an
// isinstance check and a new reference each): an eager call with a module
// argument passes each of its parameters here, on every call.
TensorList tensor_list_argument(py::handle sequence, const char* what) {
  PyObject* seq = sequence.ptr();
  const bool is_list = PyList_CheckExact(seq);
  if (!is_list && !PyTuple_CheckExact(seq)) {
    return py::cast<TensorList>(sequence); // (anything else pybind11 takes)
  }
  const Py_ssize_t n = is_list ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
  TensorList out;
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item =
        is_list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
    if (!torch_private::is_exact_tensor(item) && !THPVariable_Check(item)) {
      throw py::type_error(c10::str(
          "torchleaf: ",
          what,
          " must hold tensors only; item ",
          i,
          " is a ",
          Py_TYPE(item)->tp_name));
    }
    out.push_back(THPVariable_Unpack(item));
  }
  return out;
}

py::list wrap_tensors(const TensorList& tensors) {
  py::list out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* item = THPVariable_Wrap(tensors[i]);
    if (item == nullptr) {
      throw python_error();
    }
    PyList_SET_ITEM(out.ptr(), i, item);
  }
  return out;
}

// The call's arguments: this frontend's payload (CallSite::frontend_payload).
py::handle arguments_of(const CallSite& site) {
  return site.frontend_payload != nullptr
      ? py::handle(static_cast<PyObject*>(site.frontend_payload))
      : py::handle(Py_None);
}

TensorList run_python_real(
    const PythonLeaf& leaf,
    const std::string& name,
    const TensorList& inputs,
    CallSite& site) {
  py::gil_scoped_acquire gil;
  // A vector call: this runs on every call of a Python leaf.
  py::object plan =
      py::reinterpret_steal<py::object>(PyLong_FromLongLong(site.plan));
  if (!plan) {
    throw py::error_already_set();
  }
  py::list tensors = wrap_tensors(inputs);
  PyObject* args[] = {
      ptr(leaf.leaf_ref), plan.ptr(), tensors.ptr(), arguments_of(site).ptr()};
  py::object result = py::reinterpret_steal<py::object>(
      PyObject_Vectorcall(ptr(leaf.runner), args, 4, nullptr));
  if (!result) {
    throw py::error_already_set(); // as pybind11's own call would (fetches the
                                   // error)
  }
  TORCH_INTERNAL_ASSERT(
      PyTuple_Check(result.ptr()) && PyTuple_GET_SIZE(result.ptr()) == 2);
  auto outputs = unpack_tensors(
      PyTuple_GET_ITEM(result.ptr(), 0),
      name,
      "real",
      &site.outputs_held.emplace());
  site.result = hold(
      py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(result.ptr(), 1)));
  return outputs;
}

TensorList run_python_fake(
    const PythonLeaf& leaf,
    const std::string& name,
    const TensorList& inputs,
    CallSite& site) {
  py::gil_scoped_acquire gil;
  // Validation runs the fake after the real function of the same call, whose
  // output description it compares against.
  py::handle real_desc =
      site.result ? py::handle(ptr(site.result)) : py::handle(Py_None);
  py::object result = py::reinterpret_borrow<py::object>(ptr(leaf.fake_runner))(
      py::handle(ptr(leaf.leaf_ref)),
      site.plan,
      wrap_tensors(inputs),
      arguments_of(site),
      real_desc);
  return unpack_tensors(result, name, "fake");
}

std::string name_python_input(
    const PythonLeaf& leaf,
    int64_t plan,
    size_t index) {
  py::gil_scoped_acquire gil;
  py::handle namer(ptr(leaf.input_namer));
  if (namer.is_none()) {
    return {};
  }
  try {
    py::object name = namer(py::handle(ptr(leaf.leaf_ref)), plan, index);
    return name.is_none() ? std::string() : name.cast<std::string>();
  } catch (py::error_already_set&) {
    return {}; // named by position instead (describe_input)
  }
}

int64_t define_python_leaf(
    const std::string& name,
    py::object runner,
    py::object fake_runner,
    py::object leaf_ref,
    std::optional<bool> validate_outputs,
    std::optional<bool> check_escaped_gradients,
    py::object input_namer) {
  auto leaf = std::make_shared<PythonLeaf>(PythonLeaf{
      hold(std::move(runner)),
      hold(std::move(fake_runner)),
      hold(std::move(leaf_ref)),
      hold(std::move(input_namer))});
  auto entry = std::make_shared<LeafEntry>();
  entry->name = name;
  entry->real = [leaf, name](const TensorList& in, CallSite& site) {
    return run_python_real(*leaf, name, in, site);
  };
  entry->fake = [leaf, name](const TensorList& in, CallSite& site) {
    return run_python_fake(*leaf, name, in, site);
  };
  entry->input_name = [leaf](int64_t plan, size_t index) {
    return name_python_input(*leaf, plan, index);
  };
  entry->options.validate_outputs = validate_outputs;
  entry->options.check_escaped_gradients = check_escaped_gradients;
  return register_leaf(std::move(entry));
}

// Returns (outputs, output description), or None when the call carries
// eager-only `arguments` but something records it (a dispatch mode or a
// functorch transform): the caller then describes it for a graph instead.
py::object call(
    int64_t leaf,
    int64_t plan,
    py::handle input_list,
    py::handle mutated_list,
    py::handle arguments) {
  HANDLE_TH_ERRORS
  const TensorList inputs = tensor_list_argument(input_list, "inputs");
  const TensorList mutated = tensor_list_argument(mutated_list, "mutated");
  const bool eager = ops::is_plain_eager(inputs, mutated);
  if (!eager && !arguments.is_none()) {
    return py::none();
  }
  CallSite site{plan};
  if (eager && !arguments.is_none()) {
    // An eager call with its arguments returns what the function returned.
    site.frontend_payload = arguments.ptr();
    site.outputs_as_returned = true;
  }
  // The GIL stays held: the work is the Python runner's (the user's
  // operators release it as usual), and dropping tensors that had Python
  // objects without it would take it back once per tensor.
  TensorList out;
  if (eager) {
    auto entry = get_leaf(leaf);
    out = ops::call_eager(*entry, inputs, mutated, site);
  } else {
    out = ops::call(leaf, plan, inputs, mutated);
  }
  py::object desc = site.result
      ? py::reinterpret_borrow<py::object>(ptr(site.result))
      : py::none();
  return py::make_tuple(wrap_tensors(out), std::move(desc));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::list run_fake(
    int64_t leaf,
    int64_t plan,
    const TensorList& inputs,
    const TensorList& mutated,
    bool strides_relied_on) {
  HANDLE_TH_ERRORS
  CallSite site{plan};
  return wrap_tensors(ops::call_fake(
      *get_leaf(leaf), inputs, mutated, site, strides_relied_on));
  END_HANDLE_TH_ERRORS_PYBIND
}

// The plan resolver of named Python leaves: `resolver(leaf, call)` is
// torchleaf's own function (it holds no user object).
void bind_named_operator(
    const std::string& name,
    int64_t leaf,
    bool mutating,
    py::object resolver) {
  HANDLE_TH_ERRORS
  auto held = hold(std::move(resolver));
  ops::bind_named_operator(
      name, leaf, mutating, [held](int64_t id, const std::string& call) {
        py::gil_scoped_acquire gil;
        return py::reinterpret_borrow<py::object>(ptr(held))(id, call)
            .cast<int64_t>();
      });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::list named_leaves() {
  py::list out;
  for (const auto& e : torchleaf::named_leaves()) {
    out.append(py::make_tuple(e->id, e->name, e->options.mutates_inputs));
  }
  return out;
}

// ------------------------------------------------- saved-tensor hooks

// torchleaf._registration._saved_hook_may_copy (a function of the package,
// not a user object: it lives as long as the module).
PyObject* g_saved_hook_may_copy = nullptr;

bool python_saved_hook_may_copy(const c10::SafePyObject& pack_hook) {
  if (g_saved_hook_may_copy == nullptr || !Py_IsInitialized()) {
    return true;
  }
  py::gil_scoped_acquire gil;
  py::error_scope pending;
  try {
    auto hook = py::handle(pack_hook.ptr(torch_private::py_interpreter()));
    return py::handle(g_saved_hook_may_copy)(hook).cast<bool>();
  } catch (py::error_already_set&) {
    return true; // keep the state: the safe answer
  }
}

} // namespace
} // namespace torchleaf::python

PYBIND11_MODULE(_C, m) {
  using namespace torchleaf;
  using namespace torchleaf::python;
  m.doc() = "torchleaf's C++ core. Private: use the torchleaf package.";

  m.def(
      "_set_error_type",
      [](py::object type) {
        Py_XDECREF(g_leaf_error_type);
        g_leaf_error_type = type.release().ptr();
        set_error_thrower(&throw_python_leaf_error);
        set_foreign_error_noter(&note_python_error);
      },
      "Make torchleaf errors raise `type` (a RuntimeError subclass).");

  m.def(
      "_set_saved_hook_may_copy",
      [](py::object check) {
        Py_XDECREF(g_saved_hook_may_copy);
        g_saved_hook_may_copy = check.release().ptr();
        set_saved_hook_may_copy(&python_saved_hook_may_copy);
      },
      "Set check(pack_hook) -> bool: whether a saved-tensor pack hook may save a "
      "copy of a state handle (the core then keeps the state for the copy).");

  m.def(
      "define_python_leaf",
      &define_python_leaf,
      py::arg("name"),
      py::arg("runner"),
      py::arg("fake_runner"),
      py::arg("leaf_ref"),
      py::arg("validate_outputs") = py::none(),
      py::arg("check_escaped_gradients") = py::none(),
      py::arg("input_namer") = py::none(),
      "Register a Python leaf with the core and return its id. The core "
      "calls runner(leaf_ref, plan, tensors, arguments) -> (tensors, "
      "output description) and fake_runner(leaf_ref, plan, tensors, "
      "arguments, real description or None) -> tensors; for an error "
      "message, input_namer(leaf_ref, plan, index) -> str or None names the "
      "call's flat input `index` as its caller wrote it. `leaf_ref` should "
      "be a weak reference, so that the core keeps no user object alive.");
  m.def(
      "bind_named_operator",
      &bind_named_operator,
      py::arg("name"),
      py::arg("leaf"),
      py::arg("mutating"),
      py::arg("resolver"),
      "Make the operator `name` ('ns::op', defined on first use with schema "
      "(Tensor[] inputs, [Tensor(a!)[] mutated,] str call) -> Tensor[]) call "
      "the Python leaf `leaf`; resolver(leaf, call) -> plan turns a call "
      "description into a plan, once per distinct description. Fails when "
      "a live leaf or a C++ leaf has the name.");
  m.def(
      "release_python_leaf",
      &unregister_leaf,
      py::arg("leaf"),
      "Remove a Python leaf from the core (when its LeafFunction dies); "
      "graphs that still call it fail with a clear error.");
  m.attr("OPERATOR_SCHEMA_VERSION") = ops::kOperatorSchemaVersion;
  // The torch release this extension was compiled against ("2.13.0"):
  // torchleaf/__init__.py refuses to run it under another.
  m.attr("BUILT_TORCH_VERSION") = TORCH_VERSION;
  m.def(
      "leaf_count", &leaf_count, "Number of leaves registered with the core.");
  m.def(
      "call",
      &call,
      py::arg("leaf"),
      py::arg("plan"),
      py::arg("inputs"),
      py::arg("mutated"),
      py::arg("arguments"),
      "Call a leaf. Plain eager calls run directly (no dispatcher round "
      "trip) with `arguments` (opaque, handed to the runners) and return "
      "(outputs, the real function's output description). Other calls go "
      "through torchleaf::call(leaf, plan, ...) and return (outputs, None) "
      "-- or None, without running anything, when `arguments` is not None: "
      "such calls must be described for a graph.");

  m.def(
      "run_fake",
      &run_fake,
      py::arg("leaf"),
      py::arg("plan"),
      py::arg("inputs"),
      py::arg("mutated"),
      py::arg("strides_relied_on") = false,
      "Run a leaf's fake implementation for a call of `plan` (the fake "
      "kernel of every torchleaf operator). The outputs' metadata is "
      "recorded for the check of real calls, their strides only when "
      "`strides_relied_on` (Inductor's lowering).");
  m.def(
      "direct_operator_entry",
      &direct_operator_entry,
      py::arg("name"),
      py::arg("replaced"),
      "A callable for OpOverload._op of torchleaf::<name> ('call', 'forward' "
      "or 'backward'): calls the operator through a typed dispatcher call for "
      "the plain positional arguments compiled graphs pass, and `replaced` "
      "(PyTorch's own entry) for anything else.");
  m.def(
      "named_leaves",
      &torchleaf::python::named_leaves,
      "[(id, 'ns::name', mutable positions)] for every C++ leaf with a named "
      "operator.");
  m.def(
      "live_states",
      &live_states,
      "Number of captured autograd states alive now.");
  m.def(
      "get_validate_outputs",
      &Config::validate_outputs,
      "Whether real and fake outputs are compared on every call.");
  m.def(
      "set_validate_outputs",
      &Config::set_validate_outputs,
      py::arg("enabled"),
      "Compare real and fake outputs on every call (default off).");
  m.def(
      "get_check_escaped_gradients",
      &Config::check_escaped_gradients,
      "Whether escaped gradients are an error.");
  m.def(
      "set_check_escaped_gradients",
      &Config::set_check_escaped_gradients,
      py::arg("enabled"),
      "Make escaped gradients an error (default on).");
  m.def(
      "scalar_type_code",
      [](const at::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); },
      "The c10::ScalarType code of a tensor's dtype.");
  m.def(
      "device_type_name",
      [](int64_t code) {
        return c10::DeviceTypeName(
            static_cast<c10::DeviceType>(code), /*lower_case=*/true);
      },
      "The name ('cpu', 'cuda', ...) of a c10::DeviceType code.");
  add_module_entry_functions(m);
  add_module_call(m);
}
