// torchleaf._C: thin pybind11 bindings over the C++ core. Python leaf
// functions become core leaves whose real and fake functions are trampolines
// into Python; everything else (operators, capture, replay, checks, state
// lifetimes) is the core's.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/DeviceType.h>

#include <torchleaf/torchleaf.h>

#include "../ops/leaf_ops.h"
#include "../registry.h"
#include "../state.h"

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
    return g_leaf_error_type != nullptr ? g_leaf_error_type : PyExc_RuntimeError;
  }
};

[[noreturn]] void throw_python_leaf_error(const std::string& message) {
  throw PyLeafError(message);
}

// ------------------------------------------------------------ Python leaves

// One Python leaf entry: `runner(tensors, call)` runs the user's function and
// returns (list of tensors, output description); `fake_runner(tensors, call,
// real_desc)` runs its fake and returns a list of tensors (`real_desc`: the
// real call's output description when validating it, else None).
// `call` describes how to rebuild the user's arguments; None means "the call
// being made on this thread now" (eager calls pass it through _C.call).
struct PythonLeaf {
  py::object runner;
  py::object fake_runner;
  py::object call;
};

thread_local PyObject* t_current_call = nullptr;
// Output description of the real call that just ran on this thread, handed
// back to the Python wrapper by _C.call, and to the fake runner when it
// validates the same call (recognised by receiving the very same inputs).
thread_local PyObject* t_output_desc = nullptr;
thread_local const TensorList* t_output_desc_inputs = nullptr;

void set_output_desc(PyObject* desc, const TensorList* inputs = nullptr) {
  Py_XINCREF(desc);
  Py_XDECREF(t_output_desc);
  t_output_desc = desc;
  t_output_desc_inputs = inputs;
}

py::object take_output_desc() {
  PyObject* desc = t_output_desc;
  t_output_desc = nullptr;
  return desc ? py::reinterpret_steal<py::object>(desc) : py::none();
}

TensorList unpack_tensors(const py::handle& result, const std::string& leaf, const char* what) {
  TensorList out;
  if (!PyList_Check(result.ptr())) {
    detail::throw_leaf_error(leaf, std::string(what) + " runner must return a list of tensors");
  }
  const auto n = PyList_GET_SIZE(result.ptr());
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(result.ptr(), i);
    if (!THPVariable_Check(item)) {
      detail::throw_leaf_error(
          leaf,
          std::string(what) + " function returned a " + Py_TYPE(item)->tp_name +
              " where a tensor was expected");
    }
    out.push_back(THPVariable_Unpack(item));
  }
  return out;
}

TensorList trampoline(
    const PythonLeaf* leaf,
    const std::string& name,
    bool fake,
    const TensorList& inputs) {
  py::gil_scoped_acquire gil;
  PyObject* call = leaf->call.is_none() ? t_current_call : leaf->call.ptr();
  TORCHLEAF_CHECK(
      call != nullptr,
      name,
      "was called without its Python arguments. Call the decorated function "
      "itself rather than torch.ops.torchleaf.call with an eager leaf id.");
  py::list args(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    PyList_SET_ITEM(args.ptr(), i, THPVariable_Wrap(inputs[i]));
  }
  if (fake) {
    // Validation runs the fake on the real call's own inputs.
    const bool validating = t_output_desc != nullptr && t_output_desc_inputs == &inputs;
    py::handle real_desc = validating ? py::handle(t_output_desc) : py::handle(Py_None);
    return unpack_tensors(
        leaf->fake_runner(args, py::handle(call), real_desc), name, "fake");
  }
  py::object result = leaf->runner(args, py::handle(call));
  TORCH_INTERNAL_ASSERT(PyTuple_Check(result.ptr()) && PyTuple_GET_SIZE(result.ptr()) == 2);
  set_output_desc(PyTuple_GET_ITEM(result.ptr(), 1), &inputs);
  return unpack_tensors(PyTuple_GET_ITEM(result.ptr(), 0), name, "real");
}

int64_t define_python_leaf(
    const std::string& name,
    py::object runner,
    py::object fake_runner,
    py::object call,
    std::optional<bool> validate_outputs,
    std::optional<bool> check_escaped_gradients) {
  // Immortal, like every entry: graphs may refer to it until the process ends.
  auto* leaf = new PythonLeaf{std::move(runner), std::move(fake_runner), std::move(call)};
  auto entry = std::make_unique<LeafEntry>();
  entry->name = name;
  entry->real = [leaf, name](const TensorList& in) {
    return trampoline(leaf, name, /*fake=*/false, in);
  };
  entry->fake = [leaf, name](const TensorList& in) {
    return trampoline(leaf, name, /*fake=*/true, in);
  };
  entry->options.validate_outputs = validate_outputs;
  entry->options.check_escaped_gradients = check_escaped_gradients;
  return register_leaf(std::move(entry)).id;
}

py::list wrap_tensors(TensorList tensors) {
  py::list out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), i, THPVariable_Wrap(std::move(tensors[i])));
  }
  return out;
}

py::tuple call(int64_t leaf, const TensorList& inputs, const TensorList& mutated, py::handle call) {
  HANDLE_TH_ERRORS
  struct CurrentCall {
    PyObject* saved;
    explicit CurrentCall(PyObject* c) : saved(t_current_call) {
      t_current_call = c;
    }
    ~CurrentCall() {
      t_current_call = saved;
      set_output_desc(nullptr); // never leave a stale description behind
    }
  } current(call.is_none() ? nullptr : call.ptr());
  TensorList out;
  {
    py::gil_scoped_release no_gil;
    out = ops::call(leaf, inputs, mutated);
  }
  py::object desc = take_output_desc();
  return py::make_tuple(wrap_tensors(std::move(out)), std::move(desc));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::list run_fake(int64_t leaf, const TensorList& inputs, const TensorList& mutated) {
  HANDLE_TH_ERRORS
  return wrap_tensors(ops::call_fake(get_leaf(leaf), inputs, mutated));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::list named_leaves() {
  py::list out;
  for (auto id : named_leaf_ids()) {
    const auto& e = get_leaf(id);
    out.append(py::make_tuple(id, e.name, e.options.mutates_inputs));
  }
  return out;
}

} // namespace
} // namespace torchleaf::python

PYBIND11_MODULE(_C, m) {
  using namespace torchleaf;
  using namespace torchleaf::python;
  m.doc() = "torchleaf's C++ core. Private: use the torchleaf package.";

  m.def("_set_error_type", [](py::object type) {
    Py_XDECREF(g_leaf_error_type);
    g_leaf_error_type = type.release().ptr();
    set_error_thrower(&throw_python_leaf_error);
  }, "Make torchleaf errors raise `type` (a RuntimeError subclass).");

  m.def("define_python_leaf", &define_python_leaf,
        py::arg("name"), py::arg("runner"), py::arg("fake_runner"),
        py::arg("call"), py::arg("validate_outputs") = py::none(),
        py::arg("check_escaped_gradients") = py::none(),
        "Register a Python leaf with the core and return its id. `call` is "
        "the fixed call description passed to the runners, or None to take it "
        "from the enclosing _C.call.");
  m.def("call", &call, py::arg("leaf"), py::arg("inputs"), py::arg("mutated"),
        py::arg("call"),
        "Call leaf `leaf` through torchleaf::call (all dispatch keys), with "
        "`call` as the Python call description for runners that take it from "
        "the caller. Returns (outputs, output description of the real call, "
        "or None when a tracer ran the fake instead). Releases the GIL around "
        "the C++ work.");

  m.def("run_fake", &run_fake, py::arg("leaf"), py::arg("inputs"),
        py::arg("mutated"), "Run a leaf's fake implementation (C++ leaves).");
  m.def("named_leaves", &named_leaves,
        "[(id, 'ns::name', mutable positions)] for every C++ leaf with a named "
        "operator.");
  m.def("live_states", &live_states,
        "Number of captured autograd states alive now.");
  m.def("get_validate_outputs", &Config::validate_outputs,
        "Whether real and fake outputs are compared on every call.");
  m.def("set_validate_outputs", &Config::set_validate_outputs, py::arg("enabled"),
        "Compare real and fake outputs on every call (default off).");
  m.def("get_check_escaped_gradients", &Config::check_escaped_gradients,
        "Whether escaped gradients are an error.");
  m.def("set_check_escaped_gradients", &Config::set_check_escaped_gradients,
        py::arg("enabled"), "Make escaped gradients an error (default on).");
  m.def("scalar_type_code", [](const at::Tensor& t) {
    return static_cast<int64_t>(t.scalar_type());
  }, "The c10::ScalarType code of a tensor's dtype.");
  m.def("device_type_name", [](int64_t code) {
    return c10::DeviceTypeName(static_cast<c10::DeviceType>(code), /*lower_case=*/true);
  }, "The name ('cpu', 'cuda', ...) of a c10::DeviceType code.");
}
