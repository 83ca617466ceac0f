#pragma once

// Every private or internal PyTorch C++ API that torchleaf uses, and the only
// place that includes their headers or names them: each is a debt, and the
// place where a PyTorch release that changes one gets its switch. Each entry
// says what torchleaf uses it for. Checked on PyTorch 2.13 (the release the
// build and the test suites pin; the inline replay's engine internals are
// compiled on 2.13 only: TORCHLEAF_INLINE_REPLAY_SUPPORTED in replay.h).
// docs/design.md's table of private APIs lists the same entries. One per
// line, machine-readable:
//
// PRIVATE-API: c10::impl::tls_local_dispatch_key_set — this thread's included/excluded dispatch keys: tracing and functorch detection, the keys user code runs with
// PRIVATE-API: c10::impl::tls_is_dispatch_key_included — detach's fast path: no Python dispatch key included
// PRIVATE-API: c10::impl::ForceDispatchKeyGuard — running the body and replays with the dispatch keys of code outside any kernel
// PRIVATE-API: c10::impl::ExcludeDispatchKeyGuard — Functionalize kernels call the functional variant below Functionalize
// PRIVATE-API: at::functionalization::impl — unwrap, sync, write back and rewrap functional tensors around a mutating leaf call
// PRIVATE-API: at::SavedTensorDefaultHooks::get_hooks — whether saved-tensor hooks that may copy a state handle are active
// PRIVATE-API: torch::jit::tracer::isTracing — refusing torch.jit.trace, which would bake a leaf's inputs in as constants
// PRIVATE-API: torch::autograd::Engine::execute — replaying a captured graph from its output edges to its input sinks
// PRIVATE-API: torch::autograd::get_current_graph_task_id — whether a backward is running (keep_graph of a replay, state release)
// PRIVATE-API: torch::autograd::get_current_graph_task_keep_graph — whether the running backward retains its graph
// PRIVATE-API: c10::AutogradState — forward-grad mode, which an autograd.Function's forward turns off: a compiled graph's create_graph backward
// PRIVATE-API: torch::autograd::get_current_graph_task_exec_info — inline replay: an enclosing backward restricted to some inputs goes to the engine
// PRIVATE-API: torch::autograd::InputBuffer — inline replay: summing two gradients of one slot as the engine does
// PRIVATE-API: torch::autograd::validate_outputs — inline replay: the engine's checks and casts of gradients
// PRIVATE-API: torch::autograd::AnomalyMode::is_enabled — inline replay: anomaly mode goes to the engine
// PRIVATE-API: at::impl::ThreadLocalPythonObjects — setting aside the Python context PyTorch's backward stashes, during a replay
// PRIVATE-API: torch::autograd::impl::get_autograd_meta — forward-mode tangent check without autograd's locks (AutogradMeta::fw_grad_, is_view_)
// PRIVATE-API: torch::autograd::impl::get_view_autograd_meta — a view's base (DifferentiableViewMeta, ViewInfo::base_): a gradient or output that is a view of a tensor nothing else holds needs no copy
// PRIVATE-API: torch::autograd::impl::gradient_edge — a tensor's edge in the caller's graph and a captured output's
// PRIVATE-API: torch::autograd::impl::set_gradient_edge — pointing an input alias at its sink
// PRIVATE-API: torch::autograd::set_history — putting torchleaf's nodes behind outputs
// PRIVATE-API: torch::autograd::Edge::function — how autograd holds a node (std::shared_ptr in 2.11, c10::intrusive_ptr in 2.13 and later): make_node matches it
// PRIVATE-API: torch::autograd::collect_next_edges — the next edges of torchleaf's nodes
// PRIVATE-API: at::sequence_number::peek — the escape walk: nodes this thread made before the call (with Node::sequence_nr, Node::thread_id)
// PRIVATE-API: at::RecordFunction::currentThreadId — the escape walk: which nodes this thread made
// PRIVATE-API: torch::autograd::AccumulateGrad — leaf tensors in the escape walk, known by sequence number UINT64_MAX and type
// PRIVATE-API: c10::TensorImpl::shallow_copy_and_detach — detach of a plain tensor without the dispatcher
// PRIVATE-API: typeid names of autograd nodes — nodes that never run Python: torch::autograd::generated and torchleaf
// PRIVATE-API: torch::dynamo::autograd::CompiledNodeArgs — compiled autograd: the cache key of torchleaf's nodes
// PRIVATE-API: torch::dynamo::autograd::SwapSavedVariables — compiled autograd: tracing torchleaf's nodes' apply
// PRIVATE-API: at::impl::torch_function_mode_enabled — Python bindings: direct operator entries hand torch function modes to PyTorch
// PRIVATE-API: THPVariable_CheckExact — Python bindings: direct operator entries take exact tensors only
// PRIVATE-API: getPyInterpreter — Python bindings: the Python object of a saved-tensor pack hook
//
// The Python-binding entries are compiled only with TORCHLEAF_PYTHON_BINDINGS
// (the torchleaf._C target): the core never includes Python headers.

#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/SequenceNumber.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/AutogradState.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/jit/frontend/tracer.h>

#ifdef TORCHLEAF_PYTHON_BINDINGS
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#endif

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace torchleaf::torch_private {

// ------------------------------------------------------- dispatch keys

using LocalDispatchKeySet = c10::impl::LocalDispatchKeySet;
using ForceDispatchKeyGuard = c10::impl::ForceDispatchKeyGuard;
using ExcludeDispatchKeyGuard = c10::impl::ExcludeDispatchKeyGuard;

inline LocalDispatchKeySet tls_local_dispatch_key_set() {
  return c10::impl::tls_local_dispatch_key_set();
}

inline bool tls_is_dispatch_key_included(c10::DispatchKey key) {
  return c10::impl::tls_is_dispatch_key_included(key);
}

// ----------------------------------------------------- functionalization

namespace functionalization = at::functionalization::impl;

// -------------------------------------------------------- tensors, hooks

// The active saved-tensor default hooks (pack, unpack), also while tracing;
// nullopt when none are.
inline auto saved_tensor_default_hooks() {
  return at::SavedTensorDefaultHooks::get_hooks(/*ignore_is_tracing=*/true);
}

inline bool jit_tracing() {
  return torch::jit::tracer::isTracing();
}

// Whether `t` may carry a forward-mode tangent: it has one at some level, or
// is a view whose base may (Tensor::_fw_grad answers exactly, with a lock).
inline bool may_have_forward_grad(const at::Tensor& t) {
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta != nullptr && (meta->fw_grad_ || meta->is_view_);
}

// Whether `t`'s data is held only by `t` and by its own base, which nothing
// else holds: a view that autograd's view tracking made of a temporary (the
// weight gradient TBackward gives, `grad.t()` of a matrix product; the
// view's metadata keeps its base alive under no_grad too). Its storage is
// then shared in name only. (Conservative: a view whose forward view
// information holds the base apart answers false.)
inline bool is_view_of_unheld_base(const at::Tensor& t) {
  if (!t.is_view() || !t.has_storage() || t.storage().use_count() != 2) {
    return false;
  }
  auto* meta = torch::autograd::impl::get_view_autograd_meta(t);
  if (meta == nullptr || !meta->has_bw_view()) {
    return false;
  }
  const auto& base = meta->get_backward_view().base_;
  return base.use_count() == 1 && base.has_storage() &&
      base.storage().is_alias_of(t.storage());
}

// t.detach() of a plain tensor (one TensorImpl, its version counter shared).
inline at::Tensor shallow_detach(c10::TensorImpl* impl) {
  return at::Tensor(impl->shallow_copy_and_detach(
      /*version_counter=*/impl->version_counter(),
      /*allow_tensor_metadata_change=*/false));
}

// ------------------------------------------------------- autograd graph

inline torch::autograd::Edge gradient_edge(const at::Tensor& t) {
  return torch::autograd::impl::gradient_edge(t);
}

inline void set_gradient_edge(const at::Tensor& t, torch::autograd::Edge edge) {
  torch::autograd::impl::set_gradient_edge(t, std::move(edge));
}

// How autograd holds its nodes: std::shared_ptr in 2.11 (Edge::function,
// set_history), c10::intrusive_ptr in 2.13 and later. torchleaf makes its nodes
// with make_node and holds them as NodePtr, whichever the release uses.
using NodePtr = decltype(torch::autograd::Edge::function);

template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<
                    NodePtr,
                    std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

inline void set_history(const at::Tensor& t, const NodePtr& node) {
  torch::autograd::set_history(t, node);
}

template <class... Tensors>
torch::autograd::edge_list collect_next_edges(Tensors&&... tensors) {
  return torch::autograd::collect_next_edges(std::forward<Tensors>(tensors)...);
}

using AccumulateGrad = torch::autograd::AccumulateGrad;

// The sequence number the calling thread's next autograd node gets.
inline uint64_t next_sequence_nr() {
  return at::sequence_number::peek();
}

// The id Node::thread_id() records for nodes made on the calling thread.
inline uint64_t current_thread_id() {
  return at::RecordFunction::currentThreadId();
}

using CompiledNodeArgs = torch::dynamo::autograd::CompiledNodeArgs;
using SwapSavedVariables = torch::dynamo::autograd::SwapSavedVariables;

// ------------------------------------------------------------- engine

// -1 outside any backward.
inline int64_t current_graph_task_id() {
  return torch::autograd::get_current_graph_task_id();
}

inline bool current_graph_task_keep_graph() {
  return torch::autograd::get_current_graph_task_keep_graph();
}

// Whether forward-grad mode is on: the engine leaves it on, an
// autograd.Function's forward (AOTAutograd's CompiledFunctionBackward, which
// runs a compiled backward under create_graph=True) turns it off.
inline bool forward_grad_mode_enabled() {
  return c10::AutogradState::get_tls_state().get_fw_grad_mode();
}

// Whether the running backward (if any) computes only some inputs'
// gradients (torch.autograd.grad's inputs): its exec_info is not empty.
inline bool current_graph_task_is_restricted() {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info != nullptr && !exec_info->empty();
}

inline torch::autograd::variable_list engine_execute(
    const torch::autograd::edge_list& roots,
    const torch::autograd::variable_list& grads,
    bool keep_graph,
    const torch::autograd::edge_list& outputs) {
  return torch::autograd::Engine::get_default_engine().execute(
      roots,
      grads,
      keep_graph,
      /*create_graph=*/false,
      /*accumulate_grad=*/false,
      outputs);
}

using InputBuffer = torch::autograd::InputBuffer;

inline void validate_outputs(
    const torch::autograd::edge_list& edges,
    torch::autograd::variable_list& grads,
    const std::function<std::string(const std::string&)>& format_error) {
  torch::autograd::validate_outputs(edges, grads, format_error);
}

inline bool anomaly_mode_enabled() {
  return torch::autograd::AnomalyMode::is_enabled();
}

using ThreadLocalPythonObjects = at::impl::ThreadLocalPythonObjects;

namespace detail {
template <class T, class = void>
struct HasErase : std::false_type {};
template <class T>
struct HasErase<
    T,
    std::void_t<decltype(T::erase(std::declval<const std::string&>()))>>
    : std::true_type {};
} // namespace detail

// Removes `key` from this thread's Python objects. Releases without
// ThreadLocalPythonObjects::erase (2.11) have no backward that stashes an
// object there either: contains() is false, so nothing is ever erased.
template <class Objects = ThreadLocalPythonObjects>
inline void erase_thread_local_python_object(const std::string& key) {
  if constexpr (detail::HasErase<Objects>::value) {
    Objects::erase(key);
  } else {
    TORCH_INTERNAL_ASSERT(
        !Objects::contains(key),
        "torchleaf: a thread-local Python object that this PyTorch release "
        "cannot erase: ",
        key);
  }
}

#ifdef TORCHLEAF_PYTHON_BINDINGS
// ----------------------------------------------------- Python bindings

inline bool torch_function_mode_enabled() {
  return at::impl::torch_function_mode_enabled();
}

inline bool is_exact_tensor(PyObject* o) {
  return THPVariable_CheckExact(o);
}

inline c10::impl::PyInterpreter* py_interpreter() {
  return getPyInterpreter();
}
#endif

} // namespace torchleaf::torch_private
