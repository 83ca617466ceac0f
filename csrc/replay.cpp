// Replaying a captured graph: the inline path for small CPU graphs
// (replay_inline.cpp), the autograd engine for everything else.

#include "replay.h"

#include <cstring>
#include <typeinfo>

#include <torchleaf/errors.h>

#include "checks.h"
#include "torch_private.h"
#include "user_code_keys.h"

namespace torchleaf {

using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {
constexpr const char* kContextKey = "context";
} // namespace

PythonContextSetAside::PythonContextSetAside() {
  if (torch_private::ThreadLocalPythonObjects::contains(kContextKey)) {
    saved_ = torch_private::ThreadLocalPythonObjects::get(kContextKey);
    torch_private::erase_thread_local_python_object(kContextKey);
  }
}

PythonContextSetAside::~PythonContextSetAside() {
  if (saved_) {
    torch_private::ThreadLocalPythonObjects::set(
        kContextKey, std::move(saved_));
  }
}

bool runs_without_python(const Node& fn) {
  // Itanium-ABI names (GCC, Clang): PyTorch's derivative formulas live in
  // torch::autograd::generated, this library's nodes in torchleaf. Another
  // ABI's names match neither: every node then counts as Python.
  const char* name = typeid(fn).name();
  return std::strncmp(name, "N5torch8autograd9generated", 26) == 0 ||
      std::strncmp(name, "N9torchleaf", 11) == 0;
}

TensorList replay(
    const CapturedState& state,
    const std::vector<std::optional<at::Tensor>>& grads) {
  TORCHLEAF_CHECK(
      grads.size() == state.output_edges.size(),
      state.entry->name,
      "backward received ",
      grads.size(),
      " gradient(s) for ",
      state.output_edges.size(),
      " output(s); pass exactly one gradient (or None) per output.");
  edge_list roots;
  variable_list root_grads;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (state.output_edges[i].is_valid() && grads[i].has_value() &&
        grads[i]->defined()) {
      roots.push_back(state.output_edges[i]);
      root_grads.push_back(*grads[i]);
    }
  }
  variable_list results;
  if (!roots.empty() && !state.input_edges.empty()) {
    // The engine frees what it runs exactly when the enclosing backward
    // frees its own graph: with retain_graph=True (or no enclosing backward:
    // a direct call of torchleaf::backward) the captured graph stays whole
    // for the next replay; without it the outer graph, and so this state,
    // cannot be replayed again. Nodes in the captured graph see the same
    // keep_graph as the inline path shows them (the enclosing one):
    // AOTAutograd's compiled backward with donated buffers (a torch.compile'd
    // function called in the leaf's body) refuses to run under keep_graph.
    const bool keep_graph = torch_private::current_graph_task_id() == -1 ||
        torch_private::current_graph_task_keep_graph();
    // backward's kernels run below the Autograd key; the captured nodes run
    // as the engine runs any node, with Autograd dispatch on. What they call
    // may record: activation checkpointing recomputes a region when a node
    // unpacks a saved tensor, and that recomputation (a leaf call in it
    // included) must record as the forward did.
    UserCodeKeysGuard keys(!c10::InferenceMode::is_enabled());
    try {
      auto inline_results = replay_inline(state, roots, root_grads);
      if (inline_results) {
        results = std::move(*inline_results);
      } else {
        PythonContextSetAside context_set_aside; // any node, any hook
        results = torch_private::engine_execute(
            roots, root_grads, keep_graph, state.input_edges);
      }
    } catch (c10::Error& e) {
      name_the_leaf(e, "backward", *state.entry);
      throw;
    } catch (const std::exception&) {
      // A Python exception (an autograd.Function's backward): the bindings
      // add the note that eager real functions get in Python.
      detail::note_foreign_error(
          "raised inside the backward of leaf function '" + state.entry->name +
          "'");
      throw;
    }
  }
  // Both paths return one gradient per input edge, undefined where none
  // flows (nothing at all when no gradient came in).
  TensorList out = std::move(results);
  out.resize(state.input_edges.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].defined()) {
      // As for forward outputs (run_real): a graph owns its operators'
      // outputs, and Inductor reuses a dead one's buffer for an in-place
      // kernel. A gradient may share storage with another one or with an
      // incoming gradient (AddBackward passes one tensor to both inputs),
      // or be a tensor the captured graph holds; it gets its own copy. (Not
      // a view of a temporary that only the view holds: a Linear's weight
      // gradient, the transpose of a matrix product.)
      // (Contiguous when strided, as torchleaf::backward returns them: one
      // copy, not two.)
      if (out[i].use_count() > 1 ||
          (out[i].has_storage() && out[i].storage().use_count() > 1 &&
           !torch_private::is_view_of_unheld_base(out[i]))) {
        out[i] = out[i].layout() == at::kStrided
            ? out[i].clone(at::MemoryFormat::Contiguous)
            : out[i].clone();
      }
    } else {
      // The fake cannot show which inputs are used, so traced backward
      // graphs expect a tensor for every differentiable input.
      const auto& sink = state.input_edges[i];
      out[i] = sink.function->input_metadata(sink.input_nr).zeros_like();
    }
  }
  return out;
}

} // namespace torchleaf
