// Autograd kernels of the torchleaf operators.
//
// Under a tracer (make_fx, AOTAutograd, functorch, fake or functional
// tensors), a differentiable call becomes torchleaf::forward (below Autograd)
// plus a LeafBackward node whose backward is exactly torchleaf::backward, so
// the trace records both as operators and nothing per call hides in C++
// autograd state.
//
// In plain eager mode nothing needs to be recorded, so the captured graph is
// attached to the caller's graph directly (attach_to_caller): backward then
// costs what the function's own backward costs, with no replay.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <torchleaf/errors.h>

#include "../../capture.h"
#include "../../state.h"
#include "../leaf_ops.h"

namespace torchleaf::ops {

using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

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
    TORCHLEAF_CHECK(
        state_.defined(),
        entry_->name,
        "cannot run backward: its autograd state was already released by an "
        "earlier backward. Pass retain_graph=True to the first backward to "
        "backpropagate through the same call twice.");
    TORCHLEAF_CHECK(
        !(at::GradMode::is_enabled() && is_concrete_handle(state_)),
        entry_->name,
        "was recorded by a tracer and cannot be differentiated twice "
        "(create_graph=True); double backward is supported in eager mode.");
    c10::List<std::optional<at::Tensor>> g;
    g.reserve(grads.size());
    for (auto& t : grads) {
      g.push_back(t.defined() ? std::optional<at::Tensor>(std::move(t))
                              : std::nullopt);
    }
    TensorList input_grads;
    {
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

 private:
  LeafEntryPtr entry_;
  at::Tensor state_;
  std::vector<int64_t> differentiable_;
  std::vector<c10::SymInt> input_meta_;
};

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

TensorList call_autograd_kernel(int64_t leaf, int64_t plan, at::TensorList inputs) {
  return call_mutating_autograd_kernel(leaf, plan, inputs, {});
}

} // namespace

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
  if (c10::impl::tls_local_dispatch_key_set().included_.has_any(tracing_keys)) {
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
  std::vector<bool> mask(flat.tensors.size(), false);
  for (auto i : differentiable) {
    mask[flat.input_positions[i]] = true;
  }
  // Sinks are created in flat order; match the caller's edges to them.
  edge_list caller_edges;
  TensorList captured;
  caller_edges.reserve(differentiable.size());
  captured.reserve(differentiable.size());
  for (size_t pos = 0; pos < flat.tensors.size(); ++pos) {
    if (mask[pos]) {
      caller_edges.push_back(torch::autograd::impl::gradient_edge(flat.tensors[pos]));
      captured.push_back(flat.tensors[pos]);
    }
  }
  std::shared_ptr<CapturedState> state;
  TensorList outputs =
      run_real(entry, flat.tensors, flat.is_mutable, site, &mask, &state, &caller_edges);
  attach_to_caller(entry, *state, caller_edges, captured, outputs);
  return outputs;
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
  check_no_forward_tangents(entry, inputs, mutated);
  std::vector<int64_t> differentiable;
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) {
        differentiable.push_back(static_cast<int64_t>(i));
      }
    }
    for (size_t i = 0; i < mutated.size(); ++i) {
      TORCHLEAF_CHECK(
          !mutated[i].requires_grad(),
          entry.name,
          "declares mutable input ",
          i,
          " but it requires grad; in-place mutation of differentiable inputs "
          "is not supported. Pass a tensor that does not require grad (e.g. a "
          "buffer) or return the new value instead.");
    }
  }
  if (differentiable.empty()) {
    return std::nullopt;
  }
  if (is_plain_eager(inputs, mutated)) {
    return call_eager_differentiable(entry, inputs, mutated, differentiable, site);
  }

  std::vector<c10::SymInt> input_meta;
  for (auto i : differentiable) {
    append_input_meta(input_meta, inputs[i]);
  }
  TensorList outputs;
  at::Tensor state;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(outputs, state) = ops::forward(entry.id, site.plan, inputs, mutated, differentiable);
  }
  auto node = c10::make_intrusive<LeafBackward>(
      entry.shared_from_this(), std::move(state), std::move(differentiable), std::move(input_meta));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (auto& out : outputs) {
    if (torch::autograd::isDifferentiableType(out.scalar_type())) {
      torch::autograd::set_history(out, node);
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
  RECORD_FUNCTION("torchleaf::call", c10::ArrayRef<const c10::IValue>{});
  if (auto out = call_autograd(entry, inputs, mutated, site)) {
    return std::move(*out);
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_real(entry, inputs, mutated, site);
}

TORCH_LIBRARY_IMPL(torchleaf, Autograd, m) {
  m.impl("call", &call_autograd_kernel);
  m.impl("call_mutating", &call_mutating_autograd_kernel);
}

} // namespace torchleaf::ops
