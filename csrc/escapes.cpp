// Escape analysis of a captured call: which nodes of the graph the outputs
// reach belong to the call (CallMembership), and which edges leave it for
// tensors that require grad without being inputs (closures, globals, leaves
// made inside), whose gradients would be lost: reported as errors, or cut
// off when the leaf turned the check off.

#include "escapes.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_map>

#include <torchleaf/errors.h>

#include "checks.h"
#include "nodes.h"
#include "torch_private.h"

namespace torchleaf {

using torch::autograd::Edge;
using torch::autograd::Node;

namespace {

std::string describe(const c10::SymIntArrayRef sizes, at::ScalarType dtype) {
  std::ostringstream ss;
  ss << "Tensor(shape=" << sizes << ", dtype=" << dtype << ")";
  return ss.str();
}

// Which nodes a captured call owns. A node belongs to the call exactly when
// a path leads from it to one of the call's input sinks, or to the
// AccumulateGrad of an input the function got as it is (passed_through):
// the call's graph is what lies between its outputs and its inputs.
// Anything else the outputs reach -- a leaf that is not an input
// (AccumulateGrad), the caller's graph reached through a closure, or nodes
// of the call that lead only there -- is outside. Sequence numbers cannot
// decide this: they count per thread, so a closure built on another thread, or
// a node the function makes on a worker thread, would land on the wrong side.
//
// Nodes are classified by a depth-first walk from the outputs, memoized, and
// pruned where the answer is known without looking further: sinks and
// passed-through inputs' AccumulateGrad (inside), other AccumulateGrad
// (outside), and nodes this thread made before the call (outside: the
// caller's or a closure's, even where they lead to a passed-through input's
// AccumulateGrad; the thread's own sequence numbers do order those).
class CallMembership {
 public:
  CallMembership(const CapturedState& state, uint64_t first_sequence_nr)
      : state_(state),
        first_sequence_nr_(first_sequence_nr),
        end_sequence_nr_(torch_private::next_sequence_nr()),
        thread_(torch_private::current_thread_id()) {}

  // Whether `fn` (not null) belongs to the call: a sink or a node with a
  // path to one.
  bool inside(Node* fn) {
    if (auto known = quick(fn)) {
      return *known;
    }
    // Iterative: a graph may be deep (the caller's graph behind a closure).
    struct Frame {
      Node* node;
      size_t next = 0;
      bool reaches = false;
    };
    c10::SmallVector<Frame, 16> stack;
    remember(fn, kVisiting);
    stack.push_back(Frame{fn});
    bool result = false;
    while (!stack.empty()) {
      Frame& top = stack.back();
      if (top.next < top.node->num_outputs()) {
        Node* child = top.node->next_edge(top.next++).function.get();
        if (child == nullptr) {
          continue;
        }
        if (auto known = quick(child)) {
          top.reaches = top.reaches || *known;
          continue;
        }
        remember(child, kVisiting);
        stack.push_back(Frame{child});
        continue;
      }
      result = top.reaches;
      remember(top.node, result ? kInside : kOutside);
      if (result) {
        inside_.push_back(top.node);
      }
      stack.pop_back();
      if (!stack.empty()) {
        stack.back().reaches = stack.back().reaches || result;
      }
    }
    return result;
  }

  // The non-sink nodes found inside, each once.
  const c10::SmallVector<Node*, 16>& inside_nodes() const {
    return inside_;
  }

  // Whether the call made `fn` on this thread (for naming escaped tensors
  // only: a node made on another thread counts as not made by the call).
  bool made_here(const Node* fn) const {
    return fn->thread_id() == thread_ &&
        fn->sequence_nr() >= first_sequence_nr_ &&
        fn->sequence_nr() < kInputSinkSequenceNr;
  }

 private:
  enum Mark : uint8_t { kVisiting, kInside, kOutside, kUnknown };

  std::optional<bool> quick(const Node* fn) {
    if (is_own_sink(state_, fn) || passed_through_index(state_, fn) >= 0) {
      return true;
    }
    if (is_accumulate_grad(fn)) {
      return false;
    }
    if (fn->thread_id() == thread_ && fn->sequence_nr() < first_sequence_nr_) {
      return false; // made by this thread before the call
    }
    if (auto mark = lookup(fn)) {
      // kVisiting cannot recur in an acyclic graph; outside if it did.
      return *mark == kInside;
    }
    return std::nullopt;
  }

  // The slot of a node this thread made during the call, by its sequence
  // number (a module argument's call makes hundreds), or nullptr.
  uint8_t* made_slot(const Node* fn) {
    const uint64_t seq = fn->sequence_nr();
    if (seq < first_sequence_nr_ || seq >= end_sequence_nr_ ||
        fn->thread_id() != thread_) {
      return nullptr;
    }
    if (made_.empty()) {
      made_.resize(end_sequence_nr_ - first_sequence_nr_, kUnknown);
    }
    return &made_[seq - first_sequence_nr_];
  }

  // Nodes this thread made during the call by sequence number; others
  // (another thread's) by a linear scan, then a hash map.
  std::optional<Mark> lookup(const Node* fn) {
    if (const uint8_t* slot = made_slot(fn)) {
      return *slot == kUnknown ? std::nullopt
                               : std::optional<Mark>(Mark(*slot));
    }
    if (!large_.empty()) {
      auto it = large_.find(fn);
      return it == large_.end() ? std::nullopt
                                : std::optional<Mark>(it->second);
    }
    for (const auto& [node, mark] : small_) {
      if (node == fn) {
        return mark;
      }
    }
    return std::nullopt;
  }

  void remember(const Node* fn, Mark mark) {
    if (uint8_t* slot = made_slot(fn)) {
      *slot = mark;
      return;
    }
    if (large_.empty()) {
      for (auto& [node, m] : small_) {
        if (node == fn) {
          m = mark;
          return;
        }
      }
      if (small_.size() < kSmall) {
        small_.emplace_back(fn, mark);
        return;
      }
      large_.insert(small_.begin(), small_.end());
    }
    large_[fn] = mark;
  }

  static constexpr size_t kSmall = 32;
  const CapturedState& state_;
  const uint64_t first_sequence_nr_;
  const uint64_t end_sequence_nr_;
  const uint64_t thread_;
  // Marks of the nodes made during the call, by sequence number (kUnknown:
  // not classified yet).
  c10::SmallVector<uint8_t, 64> made_;
  c10::SmallVector<std::pair<const Node*, Mark>, kSmall> small_;
  std::unordered_map<const Node*, Mark> large_;
  c10::SmallVector<Node*, 16> inside_;
};

// Describes the tensors behind an edge that leaves the call: walks on
// through nodes the call made (w * 2 inside the function) to the tensors
// that require grad without being inputs -- leaves (AccumulateGrad) and
// nodes the call did not make (the caller's graph, another thread's).
// A leaf that is one of the body's own input aliases (`inner`) -- the body
// called requires_grad_() on an input the caller passed without grad -- goes
// to `grad_enabled_inputs` by index instead.
void describe_escaped(
    CallMembership& members,
    const Edge& edge,
    const TensorList& inner,
    c10::SmallVector<const Node*, 8>& seen,
    std::vector<std::string>& escaped,
    std::vector<size_t>& grad_enabled_inputs) {
  c10::SmallVector<const Edge*, 8> stack{&edge};
  while (!stack.empty()) {
    const Edge* e = stack.back();
    stack.pop_back();
    const Node* fn = e->function.get();
    if (fn == nullptr ||
        std::find(seen.begin(), seen.end(), fn) != seen.end()) {
      continue;
    }
    seen.push_back(fn);
    if (const auto* acc =
            dynamic_cast<const torch_private::AccumulateGrad*>(fn)) {
      const auto* impl = acc->variable.unsafeGetTensorImpl();
      const auto input =
          std::find_if(inner.begin(), inner.end(), [&](const at::Tensor& t) {
            return t.unsafeGetTensorImpl() == impl;
          });
      if (input != inner.end()) {
        grad_enabled_inputs.push_back(input - inner.begin());
      } else {
        escaped.push_back(
            describe(acc->variable.sym_sizes(), acc->variable.scalar_type()));
      }
    } else if (members.made_here(fn)) {
      for (const auto& next : fn->next_edges()) {
        stack.push_back(&next);
      }
    } else {
      const auto& meta = fn->input_metadata(e->input_nr);
      escaped.push_back(describe(
          meta.shape_as_dim_vector(), meta.options().dtype().toScalarType()));
    }
  }
}

} // namespace

// The error for inputs the body made require grad (the caller's did not).
std::string requires_grad_set_inside(
    const LeafEntry& entry,
    int64_t plan,
    c10::ArrayRef<size_t> inputs) {
  std::ostringstream ss;
  ss << "called requires_grad_() on its ";
  for (size_t n = 0; n < inputs.size(); ++n) {
    ss << (n == 0 ? "" : ", ") << describe_input(entry, plan, inputs[n]);
  }
  ss << " inside the function. A leaf's inputs are "
        "differentiable as its caller passes them, and gradients of an input "
        "that did not require grad have nowhere to go: make the argument "
        "require grad before calling the leaf, or, for torch.autograd.grad "
        "inside the function, use x.detach().requires_grad_().";
  return ss.str();
}

// Walks the captured graph from the outputs and records which inputs the
// outputs reach and every edge that leads to an input sink. Edges from the
// call's graph to anything outside it (CallMembership) are escaped
// gradients: reported when `report_escaped`, and otherwise cut off, so that
// no gradient is computed for them -- the call's own edges are cut, never
// the caller's graph. An output computed from escaped tensors alone loses
// its edge.
void walk_captured_graph(
    const LeafEntry& entry,
    int64_t plan,
    CapturedState& state,
    const TensorList& inner,
    uint64_t first_sequence_nr,
    bool report_escaped) {
  state.input_reached.assign(state.input_edges.size(), false);
  state.sink_uses.clear();
  CallMembership members(state, first_sequence_nr);
  std::vector<std::string> escaped;
  std::vector<size_t> grad_enabled_inputs;
  c10::SmallVector<const Node*, 8> seen;
  // One edge of the call's graph: to a sink, inside, or leaving the call.
  auto visit = [&](Edge& edge) {
    Node* fn = edge.function.get();
    if (fn == nullptr) {
      return;
    }
    if (auto i = sink_index(state, edge); i >= 0) {
      state.input_reached[i] = true;
      state.sink_uses.emplace_back(&edge, static_cast<size_t>(i));
      return;
    }
    if (auto i = passed_through_index(state, fn); i >= 0) {
      auto& through = state.passed_through[i];
      through.reached = true;
      if (through.sink_input != CapturedState::kNoSinkInput) {
        // Captured for replay: the gradient stops at the sink, as an
        // alias's would, and the replay returns it. (A plain assignment,
        // as attach's rewiring: both nodes are without next edges, so
        // topological numbers stay right.)
        const uint32_t input = through.sink_input;
        edge = Edge(state.sink, input);
        state.input_reached[input] = true;
        state.sink_uses.emplace_back(&edge, input);
      }
      return; // (eager: the caller's own edge)
    }
    if (members.inside(fn)) {
      return;
    }
    if (report_escaped) {
      describe_escaped(
          members, edge, inner, seen, escaped, grad_enabled_inputs);
    } else {
      edge = Edge(); // its gradient is simply not computed
    }
  };
  for (auto& e : state.output_edges) {
    // An output that is itself a leaf (made inside the function, or a
    // closure's leaf returned as is) has no history to lose.
    if (!is_accumulate_grad(e.function.get())) {
      visit(e);
    }
  }
  // Every node inside was classified by the walks above; each is visited
  // once. (inside_nodes() does not grow here: the children of a node inside
  // are all classified already.)
  const auto& inside = members.inside_nodes();
  for (size_t n = 0; n < inside.size(); ++n) {
    for (auto& next : inside[n]->next_edges()) {
      visit(next);
    }
  }
  if (!grad_enabled_inputs.empty()) {
    std::ostringstream ss;
    ss << requires_grad_set_inside(entry, plan, grad_enabled_inputs);
    if (!escaped.empty()) {
      ss << " It also uses " << escaped.size()
         << " tensor(s) that require grad but are not among its inputs (closures, globals).";
    }
    detail::throw_leaf_error(entry.name, ss.str());
  }
  if (!escaped.empty()) {
    std::ostringstream ss;
    ss << "uses " << escaped.size()
       << " tensor(s) that require grad but are not among its inputs:\n";
    for (const auto& s : escaped) {
      ss << "  - " << s << "\n";
    }
    ss << "Gradients cannot flow back to closure-captured or global tensors. "
          "Pass them as arguments (or inside an nn.Module argument), or "
          "detach them. A leaf tensor made inside the function (such as "
          "x.detach().requires_grad_() for torch.autograd.grad) is reported "
          "too: its gradient would only reach its .grad, which nothing outside "
          "the call sees. To drop such gradients knowingly, turn this check "
          "off for the leaf: @leaf_function(check_escaped_gradients=False), "
          "or torchleaf.config.check_escaped_gradients = False for all (C++: "
          "LeafOptions::check_escaped).";
    detail::throw_leaf_error(entry.name, ss.str());
  }
}

void throw_escaped_output(
    const LeafEntry& entry,
    int64_t plan,
    const TensorList& inner) {
  std::vector<size_t> grad_enabled_inputs;
  for (size_t i = 0; i < inner.size(); ++i) {
    if (inner[i].requires_grad()) {
      grad_enabled_inputs.push_back(i);
    }
  }
  TORCHLEAF_CHECK(
      grad_enabled_inputs.empty(),
      entry.name,
      requires_grad_set_inside(entry, plan, grad_enabled_inputs));
  // (A leaf tensor made inside the function has no history to lose.)
  detail::throw_leaf_error(
      entry.name,
      "returned an output that requires grad although none of its "
      "inputs does: it was computed from a tensor the function reached "
      "through a closure or a global, whose gradient would be lost. "
      "Pass that tensor (or its module) as an argument, call under "
      "torch.no_grad() if no gradient is wanted, or set "
      "torchleaf.config.check_escaped_gradients = False (C++: "
      "LeafOptions::check_escaped) to drop its gradient knowingly.");
}

} // namespace torchleaf
