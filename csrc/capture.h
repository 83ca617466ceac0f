#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <vector>

#include "registry.h"
#include "state.h"

namespace torchleaf {

// Runs `entry`'s real function on `inputs` (flat order; `mutable_inputs[i]`
// says whether input i may be mutated in place, empty: none) and checks the
// call (undeclared mutation, optional output validation). Outputs never
// alias inputs and never carry autograd history.
//
// With a `capture_mask` that selects at least one input, the function runs
// under grad mode on aliases of the selected inputs that are cut off from the
// caller's graph, and the graph it builds is returned in `*state`.
TensorList run_real(
    const LeafEntry& entry,
    const TensorList& inputs,
    const std::vector<bool>& mutable_inputs,
    const std::vector<bool>* capture_mask = nullptr,
    std::shared_ptr<CapturedState>* state = nullptr);

// Runs `entry`'s fake function, or fails with "requires a fake implementation".
TensorList run_fake(const LeafEntry& entry, const TensorList& inputs);

// Backpropagates `grads` (one per output; nullopt/undefined: no gradient)
// through `state`'s graph and returns one gradient per captured input, zeros
// where nothing flows. Never frees the graph.
TensorList replay(
    const CapturedState& state,
    const std::vector<std::optional<at::Tensor>>& grads,
    bool create_graph);

// Backward of a captured call when the caller asked for a differentiable
// backward (create_graph=True, eager only): the replay itself is captured, so
// that its results carry a graph to both `state`'s inputs (reached through
// `input_next_edges`, one per captured input) and the incoming gradients.
torch::autograd::variable_list differentiable_replay(
    const std::shared_ptr<CapturedState>& state,
    const torch::autograd::variable_list& grads,
    torch::autograd::edge_list input_next_edges);

// Autograd node that replays a captured state directly (no dispatcher): the
// backward of a differentiable_replay. Supports any order of derivatives.
struct ReplayNode final : public torch::autograd::Node {
  explicit ReplayNode(std::shared_ptr<CapturedState> state)
      : state_(std::move(state)) {}
  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override;
  std::string name() const override;
  void release_variables() override {
    state_.reset();
  }

 private:
  std::shared_ptr<CapturedState> state_;
};

} // namespace torchleaf
