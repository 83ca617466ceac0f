// Autograd kernels of the torchleaf operators.
//
// Under a tracer (make_fx, AOTAutograd, functorch, fake or functional
// tensors), a differentiable call becomes torchleaf::forward (below Autograd)
// plus a LeafBackward node whose backward is exactly torchleaf::backward, so
// the trace records both as operators and nothing per call hides in C++
// autograd state.
//
// In plain eager mode nothing needs to be recorded, so the captured graph is
// attached to the caller's graph directly (run_real_attached): backward then
// costs what the function's own backward costs, with no replay.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <torchleaf/errors.h>

#include "../../capture.h"
#include "../../profiler_range.h"
#include "../../state.h"
#include "../../torch_private.h"
#include "../kernels.h"
#include "../leaf_ops.h"
#include "traced_refusals.h"

namespace torchleaf::ops {

using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// A tensor that a torch.func transform wraps (grad or vmap).
bool is_functorch_wrapped(const at::Tensor& t) {
  constexpr auto keys = c10::DispatchKeySet(
      {c10::DispatchKey::FuncTorchGradWrapper,
       c10::DispatchKey::FuncTorchBatched});
  return t.defined() && t.key_set().has_any(keys);
}

// What a second derivative through a leaf reaches under torch.func: the
// captured graph is replayed by torchleaf::backward, which has no derivative.
constexpr const char* kTwiceDifferentiated =
    ", but a second derivative through a leaf function is not supported under "
    "torch.func transforms (grad of grad, hessian, jacrev of jacrev, a "
    "torch.func gradient inside a computation that autograd also "
    "differentiates): the leaf's backward replays its captured graph, which "
    "has no derivative of its own. Differentiate once (detach the inputs of "
    "the inner transform, or run it under torch.no_grad()), use the "
    "undecorated function, or, in eager mode, torch.autograd.grad(..., "
    "create_graph=True), which supports double backward through plain calls.";

// Put behind outputs that autograd must never differentiate: backward
// through them raises `message` (naming the leaf), where autograd's
// fallback would warn and drop the gradient.
struct LeafRefusedBackward final : public Node {
  LeafRefusedBackward(LeafEntryPtr entry, std::string message)
      : entry_(std::move(entry)), message_(std::move(message)) {}

  variable_list apply(variable_list&& /*grads*/) override {
    TORCHLEAF_CHECK(false, entry_->name, message_);
    return {};
  }

  std::string name() const override {
    return entry_->name + "RefusedBackward";
  }

  // Compiled autograd: raises the same error while tracing the backward.
  void compiled_args(torch_private::CompiledNodeArgs& /*args*/) const override {
  }
  variable_list apply_with_saved(
      const variable_list& inputs,
      torch_private::SwapSavedVariables& /*saved*/) override {
    return apply(variable_list(inputs));
  }

 private:
  LeafEntryPtr entry_;
  std::string message_;
};

// Makes backward through `outputs` raise `message`: their history becomes
// a LeafRefusedBackward node whose next edges are those of `inputs` plus
// `extra` (so that the engine runs it on the way to them).
torch::autograd::Edge refuse_backward_through(
    LeafEntryPtr entry,
    std::string message,
    const variable_list& inputs,
    TensorList& outputs,
    const torch::autograd::Edge& extra = {}) {
  auto node = torch_private::make_node<LeafRefusedBackward>(
      std::move(entry), std::move(message));
  auto edges = torch_private::collect_next_edges(inputs);
  if (extra.is_valid()) {
    edges.push_back(extra);
  }
  node->set_next_edges(std::move(edges));
  for (auto& t : outputs) {
    if (!t.defined() ||
        !torch::autograd::isDifferentiableType(t.scalar_type())) {
      continue;
    }
    for (const auto& in : inputs) {
      if (t.is_same(in)) { // never rewrite the history of an input
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        t = t.clone();
      }
    }
    torch_private::set_history(t, node);
  }
  return torch::autograd::Edge(std::move(node), 0);
}

// Whether a torch.func transform is running (its dynamic layer keys are
// included while any of its levels is active, also below the last one).
bool functorch_active() {
  return torch_private::tls_local_dispatch_key_set().included_.has(
      c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

struct LeafBackward final : public Node {
  LeafBackward(
      LeafEntryPtr entry,
      at::Tensor state,
      std::vector<int64_t> differentiable,
      std::vector<c10::SymInt> input_meta)
      : entry_(std::move(entry)),
        state_(std::move(state)),
        differentiable_(std::move(differentiable)),
        input_meta_(std::move(input_meta)) {}

  variable_list apply(variable_list&& grads) override {
    check_state_alive();
    // Under torch.func's grad transforms (create_graph is always on there)
    // the handle is wrapped; a second derivative is refused by the Autograd
    // kernels of forward and backward instead.
    TORCHLEAF_CHECK(
        !(at::GradMode::is_enabled() && !is_functorch_wrapped(state_) &&
          is_concrete_handle(state_)),
        entry_->name,
        "was recorded by a tracer and cannot be differentiated twice "
        "(create_graph=True); double backward is supported in eager mode.");
    c10::List<std::optional<at::Tensor>> g;
    g.reserve(grads.size());
    for (auto& t : grads) {
      g.push_back(
          t.defined() ? std::optional<at::Tensor>(std::move(t)) : std::nullopt);
    }
    TensorList input_grads;
    if (is_functorch_wrapped(state_)) {
      // Through the transforms' levels to the lowest, whose Autograd kernel
      // of backward links the gradients to a forward that plain autograd
      // recorded around the transform (CapturedState::refused_outer).
      input_grads = ops::backward(entry_->id, state_, g, input_meta_);
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      input_grads = ops::backward(entry_->id, state_, g, input_meta_);
    }
    TORCHLEAF_CHECK(
        input_grads.size() == differentiable_.size(),
        entry_->name,
        "backward produced ",
        input_grads.size(),
        " gradient(s) for ",
        differentiable_.size(),
        " differentiable input(s).");
    variable_list out(num_outputs());
    for (size_t k = 0; k < differentiable_.size(); ++k) {
      out[differentiable_[k]] = std::move(input_grads[k]);
    }
    return out;
  }

  std::string name() const override {
    return entry_->name + "Backward";
  }

  void release_variables() override {
    state_.reset(); // frees the captured graph unless a graph still holds it
  }

  // Compiled autograd traces apply(): the handle becomes an input of the
  // compiled backward and the call one torchleaf::backward node in it.
  void compiled_args(torch_private::CompiledNodeArgs& args) const override {
    check_state_alive();
    args.collect(entry_->id);
    args.collect(state_);
    args.collect(differentiable_);
    args.collect(input_meta_);
  }
  variable_list apply_with_saved(
      const variable_list& inputs,
      torch_private::SwapSavedVariables& saved) override {
    saved.before(state_);
    saved.before(input_meta_);
    auto out = apply(variable_list(inputs));
    saved.after(state_);
    saved.after(input_meta_);
    return out;
  }

 private:
  void check_state_alive() const {
    TORCHLEAF_CHECK(
        state_.defined(),
        entry_->name,
        "cannot run backward: its autograd state was already released by an "
        "earlier backward. Pass retain_graph=True to the first backward to "
        "backpropagate through the same call twice.");
  }

  LeafEntryPtr entry_;
  at::Tensor state_;
  std::vector<int64_t> differentiable_;
  std::vector<c10::SymInt> input_meta_;
};

} // namespace

TensorList call_mutating_autograd_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  CallSite site{plan};
  if (auto out = call_autograd(*get_leaf(leaf), inputs, mutated, site)) {
    return std::move(*out);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::call(leaf, plan, inputs, mutated);
}

TensorList call_autograd_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs) {
  return call_mutating_autograd_kernel(leaf, plan, inputs, {});
}

// Autograd kernel of forward and its variants. The leaf's own Autograd
// kernel (call_autograd) calls forward below Autograd; inputs that require
// grad here come from
//  * a torch.func grad transform, which re-enables Autograd for the level
//    below its own: that level records the call too, a second derivative.
//    While a transform is active below this level, refused here; at the
//    lowest level (plain autograd around the transform) this call cannot be
//    told from the next case, so backward through it is refused instead,
//    also through the gradients (CapturedState::refused_outer);
//  * a graph that calls forward directly (make_fx's joint graphs, run
//    eagerly), whose gradient is the graph's own torchleaf::backward.
void forward_autograd_kernel(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const auto n_args = op.schema().arguments().size();
  const auto args = torch::jit::last(*stack, n_args);
  const auto entry = get_leaf(args[0].toInt());
  variable_list tensors;
  for (const auto& arg : args) {
    if (arg.isTensorList()) {
      auto list = arg.toTensorVector();
      tensors.insert(tensors.end(), list.begin(), list.end());
    }
  }
  // A jvp outside a gradient transform (hessian, jacfwd of jacrev): the
  // tangents are on this level's inputs.
  check_no_forward_tangents(entry->name, tensors, {});
  variable_list tracked;
  if (at::GradMode::is_enabled()) {
    for (const auto& t : tensors) {
      if (t.defined() && t.requires_grad()) {
        tracked.push_back(t);
      }
    }
  }
  TORCHLEAF_CHECK(
      tracked.empty() || !functorch_active(),
      entry->name,
      "is called with inputs that require grad at an outer level of "
      "differentiation",
      kTwiceDifferentiated);
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  if (tracked.empty()) {
    return;
  }
  const auto n_returns = op.schema().returns().size();
  TensorList outputs;
  at::Tensor handle;
  for (const auto& ret : torch::jit::last(*stack, n_returns)) {
    if (ret.isTensorList()) {
      auto list = ret.toTensorVector();
      outputs.insert(outputs.end(), list.begin(), list.end());
    } else if (ret.isTensor() && !handle.defined()) {
      handle = ret.toTensor();
    }
  }
  auto refused = refuse_backward_through(
      entry,
      c10::str(
          "cannot be differentiated through the outputs of ",
          op.schema().name(),
          ": either a torch.func transform recorded the call and autograd "
          "around the transform differentiates it again",
          kTwiceDifferentiated,
          " Otherwise a graph calls ",
          op.schema().name(),
          " directly: its gradient is that graph's own torchleaf::backward; "
          "call the leaf function itself to differentiate it."),
      tracked,
      outputs);
  if (is_concrete_handle(handle)) {
    lookup_state(handle, *entry)->refused_outer = std::move(refused);
  } else if (handle.defined()) {
    remember_traced_refusal(handle, std::move(refused));
  }
  // set_history may have replaced an output (a clone of an input).
  size_t k = 0;
  for (auto& ret : torch::jit::last(*stack, n_returns)) {
    if (ret.isTensorList()) {
      auto list = ret.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        list.set(i, outputs[k++]);
      }
    }
  }
}

// torchleaf::forward's Autograd kernel, unboxed: what a compiled forward
// graph calls on every step, where no input requires grad at this level
// (AOTAutograd runs the graph with grad mode off), so the call goes straight
// below Autograd without boxing its arguments. Anything else takes the boxed
// kernel above.
std::tuple<TensorList, at::Tensor> forward_unboxed_autograd_kernel(
    c10::DispatchKeySet keys,
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable) {
  bool tracked = false;
  if (at::GradMode::is_enabled()) {
    for (const auto& t : inputs) {
      tracked = tracked || (t.defined() && t.requires_grad());
    }
  }
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torchleaf::forward", "");
  static const auto typed = op.typed<std::tuple<TensorList, at::Tensor>(
      int64_t, int64_t, at::TensorList, at::IntArrayRef)>();
  if (tracked) {
    torch::jit::Stack stack{
        leaf,
        plan,
        c10::List<at::Tensor>(inputs.vec()),
        c10::List<int64_t>(differentiable.vec())};
    forward_autograd_kernel(op, keys, &stack);
    return {
        std::move(stack[0]).toTensorVector(), std::move(stack[1]).toTensor()};
  }
  check_no_forward_tangents(leaf, inputs, {});
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return typed.redispatch(
      keys & c10::after_ADInplaceOrView_keyset,
      leaf,
      plan,
      inputs,
      differentiable);
}

// Autograd kernel of backward, reached the same way. A gradient that
// requires grad at this level (torch.func's grad always builds the graph of
// its gradients), or the state of a forward whose inputs required grad at
// this level, gets a node that refuses a second derivative if one is ever
// asked for.
TensorList backward_autograd_kernel(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta) {
  // A real handle's state names the leaf and keeps its entry: no registry
  // lookup on each step, and a backward (or, traced lazily as Inductor does,
  // its fake) works after the leaf was deleted, as the replay needs only the
  // state.
  const bool real_handle =
      !is_functorch_wrapped(state) && is_concrete_handle(state);
  auto captured = real_handle ? lookup_state(state, leaf) : nullptr;
  auto entry = captured ? captured->entry : find_leaf(leaf);
  TensorList defined;
  for (const auto& g : grads) {
    const std::optional<at::Tensor> grad = g;
    if (grad && grad->defined()) {
      defined.push_back(*grad);
    }
  }
  // A jvp of a vjp (jacfwd of jacrev): the tangents are on the gradients.
  const std::string unregistered =
      entry ? std::string() : c10::str("<id ", leaf, ">");
  check_no_forward_tangents(entry ? entry->name : unregistered, defined, {});
  TensorList out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = ops::backward(leaf, state, grads, input_meta);
  }
  if (!at::GradMode::is_enabled()) {
    return out;
  }
  variable_list tracked;
  for (const auto& g : defined) {
    if (g.requires_grad()) {
      tracked.push_back(g);
    }
  }
  torch::autograd::Edge outer;
  if (captured) {
    outer = captured->refused_outer;
  } else if (!real_handle) {
    outer = traced_refusal(state);
  }
  if (!tracked.empty() || outer.is_valid()) {
    refuse_backward_through(
        entry ? std::move(entry) : get_leaf(leaf),
        c10::str(
            "computed a gradient that is being differentiated again",
            kTwiceDifferentiated),
        tracked,
        out,
        outer);
  }
  return out;
}

bool is_plain_eager(at::TensorList inputs, at::TensorList mutated) {
  constexpr auto tracing_keys = c10::DispatchKeySet({
      c10::DispatchKey::Python,
      c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
      c10::DispatchKey::FuncTorchDynamicLayerBackMode,
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::PreDispatch,
  });
  if (torch_private::tls_local_dispatch_key_set().included_.has_any(
          tracing_keys)) {
    return false;
  }
  // Meta tensors must reach the Meta kernel (the fake), so they take the
  // operator path too.
  for (const auto& t : inputs) {
    if (t.key_set().has_any(tracing_keys) || t.is_meta()) {
      return false;
    }
  }
  for (const auto& t : mutated) {
    if (t.key_set().has_any(tracing_keys) || t.is_meta()) {
      return false;
    }
  }
  return true;
}

namespace {

TensorList call_eager_differentiable(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    const std::vector<int64_t>& differentiable,
    CallSite& site) {
  auto flat = merge_inputs(entry, inputs, mutated);
  InputFlags mask(flat.tensors.size(), false);
  for (auto i : differentiable) {
    mask[flat.input_positions[i]] = true;
  }
  return run_real_attached(entry, flat.tensors, flat.is_mutable, site, mask);
}

} // namespace

std::optional<TensorList> call_autograd(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site) {
  // First, so that a wrong count is reported as such, not as whatever the
  // checks below would make of it.
  entry.check_input_count(inputs.size() + mutated.size());
  check_no_forward_tangents(entry.name, inputs, mutated);
  std::vector<int64_t> differentiable;
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) {
        differentiable.push_back(static_cast<int64_t>(i));
      }
    }
    const auto& declared = entry.options.mutates_inputs;
    for (size_t i = 0; i < mutated.size(); ++i) {
      // C++ leaves declare input positions; a Python leaf's mutated tensors
      // are those of its mutates_args arguments, in argument order.
      TORCHLEAF_CHECK(
          !mutated[i].requires_grad(),
          entry.name,
          i < declared.size()
              ? c10::str("declares input ", declared[i], " mutable")
              : c10::str(
                    "received tensor ", i, " of its mutates_args arguments"),
          " but it requires grad; in-place mutation of differentiable inputs "
          "is not supported. Pass a tensor that does not require grad (e.g. a "
          "buffer) or return the new value instead.");
    }
  }
  if (differentiable.empty()) {
    return std::nullopt;
  }
  if (is_plain_eager(inputs, mutated)) {
    return call_eager_differentiable(
        entry, inputs, mutated, differentiable, site);
  }

  std::vector<c10::SymInt> input_meta;
  for (auto i : differentiable) {
    append_input_meta(input_meta, inputs[i]);
  }
  TensorList outputs;
  at::Tensor state;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(outputs, state) =
        ops::forward(entry.id, site.plan, inputs, mutated, differentiable);
  }
  held_by_its_handle_alone(state);
  auto node = torch_private::make_node<LeafBackward>(
      entry.shared_from_this(),
      std::move(state),
      std::move(differentiable),
      std::move(input_meta));
  node->set_next_edges(torch_private::collect_next_edges(inputs));
  for (auto& out : outputs) {
    if (torch::autograd::isDifferentiableType(out.scalar_type())) {
      torch_private::set_history(out, node);
    } else {
      node->add_input_metadata(Node::undefined_input());
    }
  }
  return outputs;
}

TensorList call_eager(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site) {
  // What the dispatcher would record for torchleaf::call, for profilers.
  const ProfilerRange range("torchleaf::call");
  if (auto out = call_autograd(entry, inputs, mutated, site)) {
    return std::move(*out);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_real(entry, inputs, mutated, site);
}

} // namespace torchleaf::ops
