#include "nodes.h"

#include <ATen/ATen.h>

#include <torchleaf/errors.h>

#include "detach.h"
#include "torch_private.h"

namespace torchleaf {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

InputSink::InputSink(
    LeafEntryPtr entry,
    const CapturedState* owner,
    int64_t index)
    : Node(kInputSinkSequenceNr),
      entry_(std::move(entry)),
      owner_(owner),
      index_(index) {}

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
  auto sink = torch_private::make_node<InputSink>(
      state.entry, &state, static_cast<int64_t>(state.input_edges.size()));
  if (caller_edge != nullptr) {
    sink->set_next_edges({*caller_edge});
  }
  sink->add_input_metadata(alias);
  torch_private::set_gradient_edge(alias, Edge(sink, 0));
  state.input_edges.emplace_back(std::move(sink), 0);
  return alias;
}

int64_t sink_index(const CapturedState& state, const Node* node) {
  if (node == nullptr || node->sequence_nr() != kInputSinkSequenceNr) {
    return -1;
  }
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(
      dynamic_cast<const InputSink*>(node) != nullptr);
  const auto* sink = static_cast<const InputSink*>(node);
  return sink->owner() == &state ? sink->index() : -1;
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
