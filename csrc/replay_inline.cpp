// The inline replay of small CPU graphs; see replay_inline in replay.h.
// Compiled only on the PyTorch releases it was verified against
// (TORCHLEAF_INLINE_REPLAY_SUPPORTED): it re-implements part of the engine.

#include "replay.h"

#if TORCHLEAF_INLINE_REPLAY_SUPPORTED

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

#include <torchleaf/config.h>

#include "nodes.h"
#include "torch_private.h"

namespace torchleaf {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// Sums `grad` into `slot` as the engine does (InputBuffer::add).
void accumulate(at::Tensor& slot, at::Tensor&& grad, Node* fn) {
  if (!slot.defined()) {
    slot = std::move(grad);
    return;
  }
  torch_private::InputBuffer sum(1);
  sum.add(0, std::move(slot), std::nullopt, std::nullopt, fn);
  sum.add(0, std::move(grad), std::nullopt, std::nullopt, fn);
  slot = std::move(sum.buffer[0]);
}

} // namespace

std::optional<variable_list> replay_inline(
    const CapturedState& state,
    const edge_list& roots,
    variable_list& root_grads) {
  constexpr size_t kMaxNodes = 32;
  if (!Config::inline_replay() || torch_private::anomaly_mode_enabled()) {
    return std::nullopt;
  }
  if (torch_private::current_graph_task_is_restricted()) {
    return std::nullopt;
  }
  c10::SmallVector<Node*, kMaxNodes> nodes;
  c10::SmallVector<int, kMaxNodes> pending; // unprocessed parents per node
  auto index_of = [&](const Node* fn) -> int64_t {
    auto it = std::find(nodes.begin(), nodes.end(), fn);
    return it == nodes.end() ? -1 : it - nodes.begin();
  };
  // (A sink with hooks, one on an input inside the function, is left to
  // the engine, which runs them on the gradient it collects there.)
  if (state.sink != nullptr && has_hooks(*state.sink)) {
    return std::nullopt;
  }
  auto eligible = [](Node* fn) {
    if (has_hooks(*fn)) {
      return false;
    }
    for (size_t i = 0; i < fn->num_inputs(); ++i) {
      if (fn->input_metadata(i).device().type() != c10::DeviceType::CPU) {
        return false;
      }
    }
    return true;
  };
  bool python_free = true;
  // Discover the nodes between the roots and the sinks, counting parents.
  for (const auto& root : roots) {
    Node* fn = root.function.get();
    if (!is_own_sink(state, fn) && index_of(fn) < 0) {
      nodes.push_back(fn);
      pending.push_back(0);
    }
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    if (nodes.size() > kMaxNodes || !eligible(nodes[n])) {
      return std::nullopt;
    }
    python_free = python_free && runs_without_python(*nodes[n]);
    for (const auto& next : nodes[n]->next_edges()) {
      Node* fn = next.function.get();
      if (fn == nullptr || is_own_sink(state, fn)) {
        continue;
      }
      auto i = index_of(fn);
      if (i < 0) {
        nodes.push_back(fn);
        pending.push_back(1);
      } else {
        ++pending[i];
      }
    }
  }

  // Each node's incoming gradients. An InputBuffer would cost four vectors
  // per node (stream and event slots, unused on the CPU); it is only needed
  // to sum a second gradient into a slot, which accumulate() does with
  // exactly its rules (in place when it may, sparse operands first).
  c10::SmallVector<variable_list, 8> buffers;
  buffers.reserve(nodes.size());
  for (auto* fn : nodes) {
    buffers.emplace_back(fn->num_inputs());
  }
  // As Engine::execute does: root gradients take their outputs' dtype (and
  // a broadcastable shape is summed), and a mismatch is the engine's error.
  torch_private::validate_outputs(
      roots, root_grads, [](const std::string& msg) { return msg; });
  variable_list results(state.input_edges.size());
  auto deliver = [&](const Edge& edge, at::Tensor grad) {
    if (auto s = sink_index(state, edge); s >= 0) {
      results[s] = results[s].defined() ? results[s] + grad : std::move(grad);
    } else {
      auto i = index_of(edge.function.get());
      accumulate(buffers[i][edge.input_nr], std::move(grad), nodes[i]);
    }
  };
  for (size_t k = 0; k < roots.size(); ++k) {
    deliver(roots[k], root_grads[k]);
  }

  at::AutoGradMode no_grad(false);
  std::optional<PythonContextSetAside> context_set_aside;
  if (!python_free) {
    context_set_aside.emplace();
  }
  c10::SmallVector<size_t, kMaxNodes> ready;
  for (size_t n = 0; n < nodes.size(); ++n) {
    if (pending[n] == 0) {
      ready.push_back(n);
    }
  }
  while (!ready.empty()) {
    const size_t n = ready.back();
    ready.pop_back();
    Node* fn = nodes[n];
    auto outputs = (*fn)(std::move(buffers[n]));
    torch_private::validate_outputs(
        fn->next_edges(), outputs, [fn](const std::string& msg) {
          return "Function " + fn->name() + " returned an " + msg;
        });
    for (size_t j = 0; j < outputs.size(); ++j) {
      const auto& next = fn->next_edge(j);
      if (!next.is_valid()) {
        continue;
      }
      if (outputs[j].defined()) {
        deliver(next, std::move(outputs[j]));
      }
      if (auto i = index_of(next.function.get()); i >= 0 && --pending[i] == 0) {
        ready.push_back(i);
      }
    }
  }
  return results;
}

} // namespace torchleaf

#endif // TORCHLEAF_INLINE_REPLAY_SUPPORTED
