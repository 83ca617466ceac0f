// Eager mode: a captured call's graph connected straight into its caller's.

#include "capture.h"
#include "detach.h"
#include "nodes.h"
#include "torch_private.h"

namespace torchleaf {

using torch::autograd::edge_list;
using torch::autograd::Node;

void attach_to_caller(
    const LeafEntry& entry,
    const CapturedState& state,
    TensorList& outputs) {
  // The captured graph now leads straight into the caller's graph; the sinks
  // stay only where saved inputs refer to them, and where the function put
  // a hook on its input (x.register_hook): gradients then pass through the
  // active sink, whose hooks the engine runs.
  // (Hooks sit on the one sink node: with any, every captured edge keeps
  // going through it, and it forwards each input to its caller's edge.)
  // (No sink when every input was passed through as it is.)
  if (state.sink != nullptr) {
    if (!has_hooks(*state.sink)) {
      for (const auto& [edge, input] : state.sink_uses) {
        *edge = state.sink->next_edge(input);
      }
    }
    static_cast<InputSink*>(state.sink.get())->activate();
  }
  bool all_reached = true;
  for (bool reached : state.input_reached) {
    all_reached = all_reached && reached;
  }
  for (const auto& through : state.passed_through) {
    all_reached = all_reached && through.reached;
  }
  if (all_reached) {
    // The common case: the outputs keep their captured graph edges, which
    // costs nothing in backward.
    return;
  }
  // Inputs the captured graph does not reach get no gradient (None), as
  // with the plain function: an idle expert's parameters keep .grad None,
  // and optimizers skip them. (Compiled graphs, which must return a tensor
  // for every differentiable input, give zeros: replay.cpp.)
  edge_list router_edges(state.output_edges.begin(), state.output_edges.end());
  auto router = torch_private::make_node<LeafRouter>(entry.shared_from_this());
  router->set_next_edges(std::move(router_edges));
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (outputs[k].requires_grad()) {
      outputs[k] = detached(outputs[k]);
    }
    // An output the captured graph does not connect to any input (a
    // constant, or one computed from cut-off tensors alone) does not
    // require grad, as with the plain function.
    if (state.output_edges[k].is_valid() &&
        torch::autograd::isDifferentiableType(outputs[k].scalar_type())) {
      torch_private::set_history(outputs[k], router);
    } else {
      router->add_input_metadata(Node::undefined_input());
    }
  }
}

} // namespace torchleaf
