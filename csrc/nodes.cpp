#include "nodes.h"

#include <ATen/ATen.h>

#include <torchleaf/errors.h>

#include "detach.h"
#include "torch_private.h"

namespace torchleaf {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

InputSink::InputSink(LeafEntryPtr entry, const CapturedState* owner)
    : Node(kInputSinkSequenceNr), entry_(std::move(entry)), owner_(owner) {}

variable_list InputSink::apply(variable_list&& grads) {
  if (active_) {
    return std::move(grads);
  }
  // Only reachable when user code inside the leaf runs a backward that
  // accumulates into the leaf's inputs.
  detail::throw_leaf_error(
      entry_->name,
      "ran .backward() through its own inputs inside its real function; "
      "gradients cannot be accumulated into a leaf's inputs from inside "
      "the leaf. Use torch.autograd.grad(outputs, inputs) there, or move "
      "the backward call out of the leaf.");
}

std::string InputSink::name() const {
  return "torchleaf::InputSink";
}

void InputSink::compiled_args(torch_private::CompiledNodeArgs& args) const {
  args.collect(active_);
}

variable_list InputSink::apply_with_saved(
    const variable_list& inputs,
    torch_private::SwapSavedVariables& /*saved*/) {
  return apply(variable_list(inputs));
}

LeafRouter::LeafRouter(LeafEntryPtr entry) : entry_(std::move(entry)) {}

variable_list LeafRouter::apply(variable_list&& grads) {
  return std::move(grads);
}

std::string LeafRouter::name() const {
  return entry_->name + "Backward";
}

void LeafRouter::compiled_args(
    torch_private::CompiledNodeArgs& /*args*/) const {}

variable_list LeafRouter::apply_with_saved(
    const variable_list& inputs,
    torch_private::SwapSavedVariables& /*saved*/) {
  return apply(variable_list(inputs));
}

at::Tensor sink_alias(
    const at::Tensor& t,
    CapturedState& state,
    const Edge* caller_edge) {
  at::Tensor alias = detached(t);
  if (state.input_edges.empty()) {
    state.input_edges.reserve(4);
    state.sink = torch_private::make_node<InputSink>(state.entry, &state);
  }
  if (caller_edge != nullptr) {
    state.sink->add_next_edge(*caller_edge);
  }
  const auto input = state.sink->add_input_metadata(alias);
  TORCH_INTERNAL_ASSERT(input == state.input_edges.size());
  torch_private::set_gradient_edge(alias, Edge(state.sink, input));
  state.input_edges.emplace_back(state.sink, input);
  return alias;
}

bool is_own_sink(const CapturedState& state, const Node* node) {
  if (node == nullptr || node->sequence_nr() != kInputSinkSequenceNr) {
    return false;
  }
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(
      dynamic_cast<const InputSink*>(node) != nullptr);
  return static_cast<const InputSink*>(node)->owner() == &state;
}

int64_t sink_index(const CapturedState& state, const Edge& edge) {
  return is_own_sink(state, edge.function.get())
      ? static_cast<int64_t>(edge.input_nr)
      : -1;
}

// PyTorch makes AccumulateGrad nodes with sequence number UINT64_MAX, which
// rules out the body's nodes before a dynamic_cast (~370 instructions each).
// test_autograd.cpp (LeafTensorsMadeInsideAreOutputsNotEscapes) pins it.
bool is_accumulate_grad(const Node* fn) {
  return fn != nullptr && fn->sequence_nr() == UINT64_MAX &&
      dynamic_cast<const torch_private::AccumulateGrad*>(fn) != nullptr;
}

bool has_hooks(Node& fn) {
  return !fn.pre_hooks().empty() || !fn.tensor_pre_hooks().empty() ||
      !fn.post_hooks().empty() || !fn.retains_grad_hooks().empty();
}

} // namespace torchleaf
