#pragma once

// The autograd nodes that a captured call puts into graphs -- a sink behind
// each captured input, and in eager mode a router behind the outputs -- and
// what the rest of the capture code asks of nodes.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <string>
#include <typeinfo>
#include <vector>

#include "registry.h"
#include "state.h"
#include "torch_private.h"

namespace torchleaf {

// Stands in for the caller's graph behind the differentiable inputs of a
// captured call: gradients stop here and are collected by the engine. One
// node per call, input i of the node for captured input i (a node per
// tensor cost an allocation, a constructor and a destructor per parameter of
// a module argument, on every call). It is never executed. In eager mode
// each input gets an edge to the caller's graph as it is added (so that
// topological numbers are right from the start), and once the call
// succeeded the captured graph's edges to it are rewired to those edges and
// the sink is activated: it then passes gradients through, for graphs that
// still reach it through saved inputs (double backward).
// Input sinks are made with this sequence number (one below AccumulateGrad's
// UINT64_MAX, which PyTorch gives no other node), so that a graph walk tells
// a sink from the body's nodes with one load, not a dynamic_cast.
constexpr uint64_t kInputSinkSequenceNr = UINT64_MAX - 1;

struct InputSink final : public torch::autograd::Node {
  // The sink of the call whose graph `owner` holds.
  InputSink(LeafEntryPtr entry, const CapturedState* owner);

  const CapturedState* owner() const {
    return owner_;
  }

  void activate() {
    active_ = true;
  }

  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override;
  std::string name() const override;

  // Compiled autograd traces apply() (pure pass-through or the error); its
  // cache key is whether the sink is active.
  void compiled_args(torch_private::CompiledNodeArgs& args) const override;
  torch::autograd::variable_list apply_with_saved(
      const torch::autograd::variable_list& inputs,
      torch_private::SwapSavedVariables& saved) override;

 private:
  LeafEntryPtr entry_;
  const CapturedState* owner_;
  bool active_ = false;
};

// Eager mode: the node behind a captured call's outputs when some input is
// not reached (its outputs then get their history anew: one computed from
// cut-off tensors alone does not require grad). Gradients pass through to
// the captured graph.
struct LeafRouter final : public torch::autograd::Node {
  explicit LeafRouter(LeafEntryPtr entry);

  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override;
  std::string name() const override;

  void compiled_args(torch_private::CompiledNodeArgs& args) const override;
  torch::autograd::variable_list apply_with_saved(
      const torch::autograd::variable_list& inputs,
      torch_private::SwapSavedVariables& saved) override;

 private:
  LeafEntryPtr entry_;
};

// Adds input metadata for `t` to the state's sink (made for the call's first
// captured input) and its edge to state.input_edges: the next captured
// input. `caller_edge`, if any, is where the sink forwards its gradient once
// activated. Returns the sink's input number.
uint32_t add_sink_input(
    const at::Tensor& t,
    CapturedState& state,
    const torch::autograd::Edge* caller_edge = nullptr);

// An alias of `t` whose gradient flows into the state's sink (made for the
// call's first captured input), recorded in `state`. `caller_edge`, if any,
// is where the sink forwards it once activated.
at::Tensor sink_alias(
    const at::Tensor& t,
    CapturedState& state,
    const torch::autograd::Edge* caller_edge = nullptr);

// Makes room in `state` for up to `n` inputs passed through.
void reserve_passed_through(CapturedState& state, size_t n);

// Records `tensor` as an input passed through as it is, unless it is
// already one (one tensor passed twice): returns whether it was recorded.
bool add_passed_through(CapturedState& state, const c10::TensorImpl* tensor);

// The questions below are asked for every edge of a captured call's graph,
// several times per edge (a module argument's call has hundreds): inline.

// Whether `fn` is a leaf tensor's AccumulateGrad. PyTorch makes those with
// sequence number UINT64_MAX, which rules out the body's nodes with one
// load; the type check is then one comparison of type_info (a dynamic_cast
// walks the hierarchy, ~370 instructions; AccumulateGrad has no
// subclasses). test_autograd.cpp (LeafTensorsMadeInsideAreOutputsNotEscapes)
// pins it.
inline bool is_accumulate_grad(const torch::autograd::Node* fn) {
  return fn != nullptr && fn->sequence_nr() == UINT64_MAX &&
      typeid(*fn) == typeid(torch_private::AccumulateGrad);
}

namespace detail {

// The slot of state.passed_through_table that holds `tensor`, or the empty
// slot where it would go: open addressing, probed from the Fibonacci hash of
// the address (the table's size is a power of two).
inline size_t passed_through_slot(
    const CapturedState& state,
    const c10::TensorImpl* tensor) {
  const auto& table = state.passed_through_table;
  const size_t mask = table.size() - 1;
  const auto bits = reinterpret_cast<uintptr_t>(tensor) >> 4;
  for (size_t slot = static_cast<size_t>(bits * 0x9E3779B97F4A7C15ull) & mask;;
       slot = (slot + 1) & mask) {
    const uint32_t entry = table[slot];
    if (entry == 0 || state.passed_through[entry - 1].tensor == tensor) {
      return slot;
    }
  }
}

} // namespace detail

// The position in state.passed_through of the input whose AccumulateGrad
// `node` is, or -1 (any other node, or an input the function got as an
// alias).
inline int64_t passed_through_index(
    const CapturedState& state,
    const torch::autograd::Node* node) {
  if (state.passed_through.empty() || !is_accumulate_grad(node)) {
    return -1;
  }
  const auto* tensor = static_cast<const torch_private::AccumulateGrad*>(node)
                           ->variable.unsafeGetTensorImpl();
  return static_cast<int64_t>(
             state.passed_through_table[detail::passed_through_slot(
                 state, tensor)]) -
      1;
}

// Whether `node` is the state's input sink (one load and a compare).
inline bool is_own_sink(
    const CapturedState& state,
    const torch::autograd::Node* node) {
  if (node == nullptr || node->sequence_nr() != kInputSinkSequenceNr) {
    return false;
  }
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(
      dynamic_cast<const InputSink*>(node) != nullptr);
  return static_cast<const InputSink*>(node)->owner() == &state;
}

// The captured input an edge into the state's sink stands for, or -1 for any
// other edge.
inline int64_t sink_index(
    const CapturedState& state,
    const torch::autograd::Edge& edge) {
  return is_own_sink(state, edge.function.get())
      ? static_cast<int64_t>(edge.input_nr)
      : -1;
}

// Whether autograd hooks sit on `fn`: the function registered them on a
// tensor (x.register_hook, retain_grad) or on its node.
bool has_hooks(torch::autograd::Node& fn);

} // namespace torchleaf
