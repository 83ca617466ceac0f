#include "nodes.h"

#include <ATen/ATen.h>

#include <typeinfo>

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

void reserve_passed_through(CapturedState& state, size_t n) {
  size_t size = 8;
  while (size < 2 * n) {
    size *= 2;
  }
  state.passed_through.reserve(n);
  state.passed_through_table.assign(size, 0);
}

bool add_passed_through(CapturedState& state, const c10::TensorImpl* tensor) {
  TORCH_INTERNAL_ASSERT(
      2 * (state.passed_through.size() + 1) <=
      state.passed_through_table.size());
  uint32_t& slot =
      state.passed_through_table[detail::passed_through_slot(state, tensor)];
  if (slot != 0) {
    return false;
  }
  state.passed_through.push_back({tensor, false, CapturedState::kNoSinkInput});
  slot = static_cast<uint32_t>(state.passed_through.size());
  return true;
}

uint32_t add_sink_input(
    const at::Tensor& t,
    CapturedState& state,
    const Edge* caller_edge) {
  if (state.input_edges.empty()) {
    state.input_edges.reserve(4);
    state.sink = torch_private::make_node<InputSink>(state.entry, &state);
  }
  if (caller_edge != nullptr) {
    state.sink->add_next_edge(*caller_edge);
  }
  const auto input = state.sink->add_input_metadata(t);
  TORCH_INTERNAL_ASSERT(input == state.input_edges.size());
  state.input_edges.emplace_back(state.sink, input);
  return input;
}

at::Tensor sink_alias(
    const at::Tensor& t,
    CapturedState& state,
    const Edge* caller_edge) {
  at::Tensor alias = detached(t);
  const auto input = add_sink_input(alias, state, caller_edge);
  torch_private::set_gradient_edge(alias, Edge(state.sink, input));
  return alias;
}

bool has_hooks(Node& fn) {
  return !fn.pre_hooks().empty() || !fn.tensor_pre_hooks().empty() ||
      !fn.post_hooks().empty() || !fn.retains_grad_hooks().empty();
}

} // namespace torchleaf
