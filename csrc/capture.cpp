#include "capture.h"

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <cstring>
#include <optional>
#include <sstream>
#include <typeinfo>
#include <unordered_map>

#include <torchleaf/config.h>
#include <torchleaf/errors.h>

#include "profiler_range.h"

namespace torchleaf {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// Stands in for the caller's graph behind each differentiable input of a
// captured call: gradients stop here and are collected by the engine. It is
// never executed. In eager mode it is created with an edge to the caller's
// graph (so that topological numbers are right from the start), and once the
// call succeeded the captured graph's edges to it are rewired to that edge
// and the sink is activated: it then passes gradients through, for graphs
// that still reach it through saved inputs (double backward).
struct InputSink final : public Node {
  explicit InputSink(LeafEntryPtr entry)
      : Node(/*sequence_nr=*/UINT64_MAX), entry_(std::move(entry)) {}

  void activate() {
    active_ = true;
  }

  variable_list apply(variable_list&& grads) override {
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
  std::string name() const override {
    return "torchleaf::InputSink";
  }

  // Compiled autograd traces apply() (pure pass-through or the error); its
  // cache key is whether the sink is active.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(active_);
  }
  variable_list apply_with_saved(
      const variable_list& inputs,
      torch::dynamo::autograd::SwapSavedVariables& /*saved*/) override {
    return apply(variable_list(inputs));
  }

 private:
  LeafEntryPtr entry_;
  bool active_ = false;
};

// Eager mode: the node behind a captured call's outputs. Gradients pass
// through to the captured graph; unreached inputs get zeros.
struct LeafRouter final : public Node {
  LeafRouter(LeafEntryPtr entry, std::vector<InputMeta> zero_meta)
      : entry_(std::move(entry)), zero_meta_(std::move(zero_meta)) {}

  variable_list apply(variable_list&& grads) override {
    variable_list out = std::move(grads);
    for (const auto& meta : zero_meta_) {
      out.push_back(at::zeros_symint(meta.sizes, meta.options));
    }
    return out;
  }

  std::string name() const override {
    return entry_->name + "Backward";
  }

  // Compiled autograd traces apply(): the zeros become graph ops, their
  // (possibly symbolic) sizes the compiled graph's.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    for (const auto& meta : zero_meta_) {
      args.collect(meta.sizes);
      args.collect(meta.options);
    }
  }
  variable_list apply_with_saved(
      const variable_list& inputs,
      torch::dynamo::autograd::SwapSavedVariables& saved) override {
    for (auto& meta : zero_meta_) {
      saved.before(meta.sizes);
    }
    auto out = apply(variable_list(inputs));
    for (auto& meta : zero_meta_) {
      saved.after(meta.sizes);
    }
    return out;
  }

 private:
  LeafEntryPtr entry_;
  std::vector<InputMeta> zero_meta_;
};

// An alias of `t` outside any autograd graph: what t.detach() returns (a
// shallow copy sharing t's version counter, without autograd metadata). A
// plain tensor gets it directly, one TensorImpl where the dispatcher's
// detach makes two through three kernels (~2k instructions, paid per input
// and per output of every call). Tensors and states whose detach a dispatch
// key may change -- subclasses, functorch and functional wrappers, Python
// dispatch, inference mode -- take detach() itself.
at::Tensor detached(const at::Tensor& t) {
  constexpr auto dispatched_keys = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (typeid(*impl) != typeid(c10::TensorImpl) || impl->key_set().has_any(dispatched_keys) ||
      impl->is_inference() || c10::InferenceMode::is_enabled() ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python)) {
    return t.detach();
  }
  return at::Tensor(impl->shallow_copy_and_detach(
      /*version_counter=*/impl->version_counter(),
      /*allow_tensor_metadata_change=*/false));
}

// Whether `fn` is a leaf tensor's AccumulateGrad. PyTorch makes those (as
// this file makes its sinks) with sequence number UINT64_MAX, which rules
// out the body's nodes before a dynamic_cast (~370 instructions each).
// test_autograd.cpp (LeafTensorsMadeInsideAreOutputsNotEscapes) pins it.
bool is_accumulate_grad(const Node* fn) {
  return fn != nullptr && fn->sequence_nr() == UINT64_MAX &&
      dynamic_cast<const torch::autograd::AccumulateGrad*>(fn) != nullptr;
}

// An alias of `t` whose gradient flows into a new sink, recorded in `state`.
// `caller_edge`, if any, is where the sink forwards once activated.
at::Tensor sink_alias(
    const at::Tensor& t,
    CapturedState& state,
    const Edge* caller_edge = nullptr) {
  at::Tensor alias = detached(t);
  auto sink = c10::make_intrusive<InputSink>(state.entry);
  if (caller_edge != nullptr) {
    sink->set_next_edges({*caller_edge});
  }
  sink->add_input_metadata(alias);
  torch::autograd::impl::set_gradient_edge(alias, Edge(sink, 0));
  state.input_edges.emplace_back(std::move(sink), 0);
  return alias;
}

// The dispatch keys of user code that runs inside a kernel (the body, a
// replayed graph), as code outside any kernel has them. A kernel below the
// Autograd key runs with the autograd keys excluded: re-enabled when
// `autograd`, as the caller of the leaf had it. A kernel reached from a
// TorchDispatchMode's handler (a user's mode, FlopCounterMode, AOTAutograd's
// runtime check of custom operators) runs with every key above Python
// excluded, the conjugate, negative and zero-tensor fallbacks among them:
// without those, `z.conj() * 1j` in the body reads z's unconjugated data.
struct UserCodeKeysGuard {
  explicit UserCodeKeysGuard(bool autograd)
      : guard_(enabled_keys(autograd)) {}

 private:
  static c10::impl::LocalDispatchKeySet enabled_keys(bool autograd) {
    constexpr auto view_fallbacks = c10::DispatchKeySet(
        {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
    auto keys = c10::impl::tls_local_dispatch_key_set();
    // ADInplaceOrView bumps version counters, which inference mode keeps
    // for normal tensors: excluded here, an in-place change in the body
    // would escape the mutation check and the saved-tensor check.
    keys.excluded_ = keys.excluded_ - view_fallbacks -
        c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);
    if (autograd) {
      keys.excluded_ =
          keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    }
    return keys;
  }
  c10::impl::ForceDispatchKeyGuard guard_;
};

std::string describe(const c10::SymIntArrayRef sizes, at::ScalarType dtype) {
  std::ostringstream ss;
  ss << "Tensor(shape=" << sizes << ", dtype=" << dtype << ")";
  return ss.str();
}

// Whether autograd hooks sit on `fn`: the function registered them on a
// tensor (x.register_hook, retain_grad) or on its node.
bool has_hooks(Node& fn) {
  return !fn.pre_hooks().empty() || !fn.tensor_pre_hooks().empty() ||
      !fn.post_hooks().empty() || !fn.retains_grad_hooks().empty();
}

// Index of `node` among the state's input sinks, or -1. Leaf calls have few
// inputs: a linear scan beats hashing.
int64_t sink_index(const CapturedState& state, const Node* node) {
  for (size_t i = 0; i < state.input_edges.size(); ++i) {
    if (state.input_edges[i].function.get() == node) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

// Which nodes a captured call owns. A node belongs to the call exactly when
// a path leads from it to one of the call's input sinks: the call's graph is
// what lies between its outputs and its (detached) inputs. Anything else the
// outputs reach -- a leaf that is not an input (AccumulateGrad), the caller's
// graph reached through a closure, or nodes of the call that lead only there
// -- is outside. Sequence numbers cannot decide this: they count per thread,
// so a closure built on another thread, or a node the function makes on a
// worker thread, would land on the wrong side.
//
// Nodes are classified by a depth-first walk from the outputs, memoized, and
// pruned where the answer is known without looking further: sinks (inside),
// AccumulateGrad (outside), and nodes this thread made before the call
// (outside: they existed before the sinks, so they have no edge to one; the
// thread's own sequence numbers do order those).
class CallMembership {
 public:
  CallMembership(const CapturedState& state, uint64_t first_sequence_nr)
      : state_(state),
        first_sequence_nr_(first_sequence_nr),
        thread_(at::RecordFunction::currentThreadId()) {}

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
    return fn->thread_id() == thread_ && fn->sequence_nr() >= first_sequence_nr_ &&
        fn->sequence_nr() != UINT64_MAX;
  }

 private:
  enum Mark : uint8_t { kVisiting, kInside, kOutside };

  std::optional<bool> quick(const Node* fn) {
    if (sink_index(state_, fn) >= 0) {
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

  // Leaf calls have small graphs: a linear scan, then a hash map.
  std::optional<Mark> lookup(const Node* fn) const {
    if (!large_.empty()) {
      auto it = large_.find(fn);
      return it == large_.end() ? std::nullopt : std::optional<Mark>(it->second);
    }
    for (const auto& [node, mark] : small_) {
      if (node == fn) {
        return mark;
      }
    }
    return std::nullopt;
  }

  void remember(const Node* fn, Mark mark) {
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
  const uint64_t thread_;
  c10::SmallVector<std::pair<const Node*, Mark>, kSmall> small_;
  std::unordered_map<const Node*, Mark> large_;
  c10::SmallVector<Node*, 16> inside_;
};

// "input 2 (argument 'buf')" where the leaf can name its inputs (Python
// leaves), else "input 2 (flattened position)".
std::string describe_input(const LeafEntry& entry, int64_t plan, size_t i) {
  std::string name;
  if (entry.input_name) {
    try {
      name = entry.input_name(plan, i);
    } catch (const std::exception&) {
      name.clear(); // an error message must not fail for want of a name
    }
  }
  return name.empty() ? c10::str("input ", i, " (flattened position)")
                      : c10::str("input ", i, " (", name, ")");
}

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
    if (fn == nullptr || std::find(seen.begin(), seen.end(), fn) != seen.end()) {
      continue;
    }
    seen.push_back(fn);
    if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(fn)) {
      const auto* impl = acc->variable.unsafeGetTensorImpl();
      const auto input = std::find_if(inner.begin(), inner.end(), [&](const at::Tensor& t) {
        return t.unsafeGetTensorImpl() == impl;
      });
      if (input != inner.end()) {
        grad_enabled_inputs.push_back(input - inner.begin());
      } else {
        escaped.push_back(describe(acc->variable.sym_sizes(), acc->variable.scalar_type()));
      }
    } else if (members.made_here(fn)) {
      for (const auto& next : fn->next_edges()) {
        stack.push_back(&next);
      }
    } else {
      const auto& meta = fn->input_metadata(e->input_nr);
      escaped.push_back(
          describe(meta.shape_as_dim_vector(), meta.options().dtype().toScalarType()));
    }
  }
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
    if (auto i = sink_index(state, fn); i >= 0) {
      state.input_reached[i] = true;
      state.sink_uses.emplace_back(&edge, static_cast<size_t>(i));
      return;
    }
    if (members.inside(fn)) {
      return;
    }
    if (report_escaped) {
      describe_escaped(members, edge, inner, seen, escaped, grad_enabled_inputs);
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

void validate_outputs(
    const LeafEntry& entry,
    const TensorList& inputs,
    const TensorList& real,
    CallSite& site) {
  TensorList fake;
  {
    at::NoGradGuard no_grad;
    fake = run_fake(entry, inputs, site); // site.result: the real description
  }
  TORCHLEAF_CHECK(
      fake.size() == real.size(),
      entry.name,
      "returned ",
      real.size(),
      " tensor(s) but its fake implementation returned ",
      fake.size(),
      ". Make the fake return the same outputs as the real function.");
  for (size_t i = 0; i < real.size(); ++i) {
    const auto& r = real[i];
    const auto& f = fake[i];
    TORCHLEAF_CHECK(
        r.defined() == f.defined(),
        entry.name,
        "output ",
        i,
        " is ",
        r.defined() ? "a tensor" : "undefined",
        " in the real function but ",
        f.defined() ? "a tensor" : "undefined",
        " in the fake implementation.");
    if (!r.defined()) {
      continue;
    }
    TORCHLEAF_CHECK(
        r.sym_sizes() == f.sym_sizes(),
        entry.name,
        "output ",
        i,
        " has shape ",
        r.sym_sizes(),
        " but its fake implementation gives shape ",
        f.sym_sizes(),
        ". Fix the fake so that shapes match.");
    TORCHLEAF_CHECK(
        r.scalar_type() == f.scalar_type(),
        entry.name,
        "output ",
        i,
        " has dtype ",
        r.scalar_type(),
        " but its fake implementation gives dtype ",
        f.scalar_type(),
        ". Fix the fake so that dtypes match.");
    TORCHLEAF_CHECK(
        r.device() == f.device(),
        entry.name,
        "output ",
        i,
        " is on device ",
        r.device(),
        " but its fake implementation puts it on ",
        f.device(),
        ". Fix the fake so that devices match.");
  }
}

} // namespace

namespace {

// Adds "while running the <what> of leaf function '<name>'" to an error
// from user code (torchleaf's own errors name the leaf already).
void name_the_leaf(c10::Error& e, const char* what, const LeafEntry& entry) {
  if (dynamic_cast<LeafError*>(&e) == nullptr) {
    e.add_context(std::string("while running the ") + what + " of leaf function '" +
                  entry.name + "'");
  }
}

// is_alias_of compares storages; sparse tensors have none (their indices and
// values are tensors of their own), and count as not aliased.
bool aliases(const at::Tensor& a, const at::Tensor& b) {
  return a.has_storage() && b.has_storage() && a.is_alias_of(b);
}

// For an error about input i: the other inputs that are views of the same
// tensor (they share its version counter, so any of them may be the one
// that changed).
std::string views_of_one_tensor(const TensorList& inputs, size_t i) {
  std::string others;
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (j != i && aliases(inputs[j], inputs[i])) {
      others += c10::str(others.empty() ? "" : ", ", j);
    }
  }
  return others.empty() ? std::string()
                        : c10::str(" or one of the inputs that are views of the same tensor (", others, ")");
}

} // namespace

void copy_aliased_outputs(TensorList& outputs, const TensorList& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    bool aliased = false;
    for (const auto& t : inputs) {
      aliased = aliased || aliases(outputs[i], t);
    }
    for (size_t j = 0; j < i; ++j) {
      aliased = aliased || aliases(outputs[i], outputs[j]);
    }
    if (aliased) {
      outputs[i] = outputs[i].clone();
    }
  }
}

TensorList run_fake(const LeafEntry& entry, const TensorList& inputs, CallSite& site) {
  TORCHLEAF_CHECK(
      static_cast<bool>(entry.fake),
      entry.name,
      "requires a fake implementation to be traced (torch.compile, make_fx, "
      "torch.export, meta or fake tensors) or validated. Register one with "
      "@",
      entry.name,
      ".register_fake (Python) or pass a fake LeafFn to "
      "torchleaf::define_leaf (C++); it must return outputs with the same "
      "structure, shapes and dtypes as the real function.");
  TensorList outputs;
  try {
    outputs = entry.fake(inputs, site);
  } catch (c10::Error& e) {
    name_the_leaf(e, "fake implementation", entry);
    throw;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCHLEAF_CHECK(
        outputs[i].defined(),
        entry.name,
        "fake implementation returned an undefined tensor at output ",
        i,
        "; it must return tensors.");
  }
  return outputs;
}

TensorList run_real(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site,
    c10::ArrayRef<bool> capture_mask,
    std::shared_ptr<CapturedState>* state_out,
    const torch::autograd::edge_list* caller_edges) {
  const ProfilerRange range(entry.name);
  // torch.jit.trace records the operations it sees: those of the body, on
  // the call's own tensors, which it would bake in as constants (a trace
  // that returns the traced inputs' results whatever it is given).
  TORCHLEAF_CHECK(
      !torch::jit::tracer::isTracing(),
      entry.name,
      "was called under torch.jit.trace, which cannot record a leaf function: "
      "it would trace the function's body with its inputs baked in as "
      "constants. Use torch.compile, or torch.export (a Python leaf needs "
      "a name, leaf_function(name=\"ns::op\")).");
  bool capture = false;
  if (!capture_mask.empty()) {
    TORCH_INTERNAL_ASSERT(capture_mask.size() == inputs.size());
    for (bool b : capture_mask) {
      capture = capture || b;
    }
  }
  std::shared_ptr<CapturedState> state;
  if (capture) {
    state = std::make_shared<CapturedState>();
    state->entry = entry.shared_from_this();
  }

  UserCodeKeysGuard keys(capture || !c10::InferenceMode::is_enabled());
  std::optional<at::AutoGradMode> grad_mode;
  if (capture) {
    grad_mode.emplace(true);
  }

  // Detached aliases: the real function sees the caller's data and version
  // counters but not the caller's graph.
  TensorList inner;
  inner.reserve(inputs.size());
  c10::SmallVector<uint32_t, 8> versions;
  versions.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    TORCHLEAF_CHECK(
        t.defined(), entry.name, "received an undefined tensor at input ", i);
    if (capture && capture_mask[i]) {
      const Edge* caller_edge = caller_edges != nullptr
          ? &(*caller_edges)[state->input_edges.size()]
          : nullptr;
      inner.push_back(sink_alias(t, *state, caller_edge));
    } else {
      inner.push_back(detached(t));
    }
    // Inference tensors have no version counter (and cannot be changed in
    // place outside inference mode).
    versions.push_back(t.is_inference() ? 0 : t._version());
  }
  // One tensor passed both as an input the function reads and as one it
  // mutates: the read would see the mutation here but not in a compiled
  // graph, which mutates a copy. Refused before the function runs.
  for (size_t m = 0; m < mutable_inputs.size(); ++m) {
    for (size_t r = 0; mutable_inputs[m] && r < inputs.size(); ++r) {
      TORCHLEAF_CHECK(
          mutable_inputs[r] || !aliases(inputs[r], inputs[m]),
          entry.name,
          "received the same tensor (or views of one tensor) as input ",
          r,
          ", which it reads, and as input ",
          m,
          ", which it mutates in place (flattened positions). Pass a clone as "
          "the read-only input, or pass the tensor only once.");
    }
  }

  const uint64_t first_sequence_nr = at::sequence_number::peek();
  TensorList outputs;
  try {
    outputs = entry.real(inner, site);
  } catch (c10::Error& e) {
    name_the_leaf(e, "real function", entry);
    throw;
  }

  for (size_t i = 0; i < inputs.size(); ++i) {
    if ((mutable_inputs.empty() || !mutable_inputs[i]) && !inputs[i].is_inference()) {
      TORCHLEAF_CHECK(
          inputs[i]._version() == versions[i],
          entry.name,
          "mutated its ",
          describe_input(entry, site.plan, i),
          views_of_one_tensor(inputs, i),
          " in place without declaring it. Declare it "
          "with mutates_args={...} (Python) or LeafOptions::mutates (C++), "
          "or clone the input before changing it.");
    }
  }
  // A declared in-place change computed from tensors that require grad gave
  // the input's alias a history; the caller's tensor gets the new data but
  // not that history (a leaf's backward is its outputs'), so the gradient of
  // what the change was computed from would be lost.
  for (size_t i = 0, k = 0; i < mutable_inputs.size(); k += mutable_inputs[i], ++i) {
    // (Named by k, its place among the declared-mutable tensors: i depends
    // on how the call was made, eager or from which graph.)
    TORCHLEAF_CHECK(
        !mutable_inputs[i] || inner[i].grad_fn() == nullptr ||
            !entry.check_escaped_gradients(),
        entry.name,
        "changed its declared-mutable tensor ",
        k,
        " (counting from 0: the tensor arguments mutates_args names, in "
        "parameter order, then the buffers of the modules it names) in place "
        "with a value that has autograd history (computed from tensors that "
        "require grad): the caller's tensor gets the new data but not that "
        "history, so their gradient through it would be lost. Compute the new "
        "value out of place and return it as an output instead, compute the "
        "change from detached tensors (or under torch.no_grad()) if no "
        "gradient is wanted, or set torchleaf.config.check_escaped_gradients "
        "= False (C++: LeafOptions::check_escaped) to drop it knowingly.");
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCHLEAF_CHECK(
        outputs[i].defined(),
        entry.name,
        "real function returned an undefined tensor at output ",
        i,
        "; it must return tensors.");
  }
  if (entry.validate_outputs()) {
    validate_outputs(entry, inner, outputs, site);
  }

  copy_aliased_outputs(outputs, inner);

  if (capture) {
    state->output_edges.reserve(outputs.size());
    for (const auto& out : outputs) {
      state->output_edges.push_back(
          out.requires_grad() ? torch::autograd::impl::gradient_edge(out)
                              : Edge());
    }
    walk_captured_graph(
        entry, site.plan, *state, inner, first_sequence_nr, entry.check_escaped_gradients());
    if (caller_edges != nullptr) {
      // An output computed only from escaped tensors lost its edge; eager
      // outputs keep their own history otherwise, which would still lead
      // there.
      for (size_t i = 0; i < outputs.size(); ++i) {
        if (!state->output_edges[i].is_valid() && outputs[i].requires_grad()) {
          outputs[i] = detached(outputs[i]);
        }
      }
    }
    *state_out = std::move(state);
  }
  if (caller_edges == nullptr) { // attach_to_caller decides for eager calls
    // Without capture no input requires grad, so an output that does was
    // computed from a tensor the function reached otherwise (a closure, a
    // global): its gradient would be dropped, which the escaped-gradients
    // check reports as it does when inputs require grad.
    const bool report_escaped = !capture && entry.check_escaped_gradients();
    for (size_t k = 0; k < outputs.size(); ++k) {
      auto& out = outputs[k];
      if (out.requires_grad()) {
        if (report_escaped && out.grad_fn() != nullptr) {
          std::vector<size_t> grad_enabled_inputs;
          for (size_t i = 0; i < inner.size(); ++i) {
            if (inner[i].requires_grad()) {
              grad_enabled_inputs.push_back(i);
            }
          }
          TORCHLEAF_CHECK(
              grad_enabled_inputs.empty(),
              entry.name,
              requires_grad_set_inside(entry, site.plan, grad_enabled_inputs));
        }
        // (A leaf tensor made inside the function has no history to lose.)
        TORCHLEAF_CHECK(
            !report_escaped || out.grad_fn() == nullptr,
            entry.name,
            "returned an output that requires grad although none of its "
            "inputs does: it was computed from a tensor the function reached "
            "through a closure or a global, whose gradient would be lost. "
            "Pass that tensor (or its module) as an argument, call under "
            "torch.no_grad() if no gradient is wanted, or set "
            "torchleaf.config.check_escaped_gradients = False (C++: "
            "LeafOptions::check_escaped) to drop its gradient knowingly.");
        out = detached(out);
      }
      // A graph owns its operators' outputs: Inductor reuses a dead output's
      // buffer for an in-place kernel. An output that something else still
      // holds -- the captured graph saved it for backward (tanh, exp,
      // sigmoid do), it is a global, a cache or a module attribute, or a
      // view of one, or another output -- would be corrupted by that, so
      // the graph gets a copy. (A tensor made in Python keeps a reference
      // from its PyObject: Python leaves say which outputs are held. Their
      // eager calls, which pass `arguments`, return what the function
      // returned, as the plain function does; an output that
      // copy_aliased_outputs replaced is no longer the held one.)
      const bool held = !site.outputs_held_known
          ? out.use_count() > 1
          : site.arguments == nullptr &&
              std::find(site.outputs_held.begin(), site.outputs_held.end(),
                        out.unsafeGetTensorImpl()) != site.outputs_held.end();
      if (held || (out.has_storage() && out.storage().use_count() > 1)) {
        out = out.clone();
      }
    }
  }
  // The outputs as the caller gets them (copies included) against what the
  // fake gave when a graph of this call was traced, if one was.
  entry.fake_outputs.check(entry, site.plan, inputs, outputs);
  return outputs;
}

bool runs_without_python(const Node& fn) {
  // Itanium-ABI names (GCC, Clang): PyTorch's derivative formulas live in
  // torch::autograd::generated, this library's nodes in torchleaf. Another
  // ABI's names match neither: every node then counts as Python.
  const char* name = typeid(fn).name();
  return std::strncmp(name, "N5torch8autograd9generated", 26) == 0 ||
      std::strncmp(name, "N9torchleaf", 11) == 0;
}

namespace {

#if TORCHLEAF_INLINE_REPLAY_SUPPORTED
// Sums `grad` into `slot` as the engine does (InputBuffer::add).
void accumulate(at::Tensor& slot, at::Tensor&& grad, Node* fn) {
  if (!slot.defined()) {
    slot = std::move(grad);
    return;
  }
  torch::autograd::InputBuffer sum(1);
  sum.add(0, std::move(slot), std::nullopt, std::nullopt, fn);
  sum.add(0, std::move(grad), std::nullopt, std::nullopt, fn);
  slot = std::move(sum.buffer[0]);
}
#endif

// PyTorch's Python backward (torch.autograd.graph._engine_run_backward)
// stashes a copy of the caller's contextvars.Context in this thread's
// Python objects under "context", and every AOTAutograd compiled backward
// runs its graph inside it (context.run), so that compiler settings are
// visible on the engine's device threads. A replay that runs inside such a
// compiled backward (the torchleaf::backward node of a compiled graph) and
// reaches another compiled function's backward (the leaf's body called a
// torch.compile'd function) would enter that same, already entered context:
// "cannot enter context: ... is already entered". While a captured graph
// replays, the stash is put aside: nested compiled backwards then run in the
// context that is current (the one the enclosing backward entered), and the
// stash is back once the replay ends, whatever happens. Three lookups in a
// string-keyed map (~1k instructions): the inline path skips it for graphs
// of C++ nodes only (runs_without_python), which never reach Python.
class PythonContextSetAside {
 public:
  PythonContextSetAside() {
    if (at::impl::ThreadLocalPythonObjects::contains(kKey)) {
      saved_ = at::impl::ThreadLocalPythonObjects::get(kKey);
      at::impl::ThreadLocalPythonObjects::erase(kKey);
    }
  }
  ~PythonContextSetAside() {
    if (saved_) {
      at::impl::ThreadLocalPythonObjects::set(kKey, std::move(saved_));
    }
  }
  PythonContextSetAside(const PythonContextSetAside&) = delete;
  PythonContextSetAside& operator=(const PythonContextSetAside&) = delete;

 private:
  static constexpr const char* kKey = "context";
  std::shared_ptr<c10::SafePyObject> saved_;
};

// Replays a small CPU graph in the calling thread. Engine::execute costs
// several microseconds per call whatever the graph's size (a graph task,
// thread-local state, a ready queue); a leaf's graph is usually a handful of
// nodes, and running them here in dependency order computes the same
// gradients for a fraction of that. Anything else goes to the engine:
// anomaly mode, hooks (tensor, pre, post, retain_grad), non-CPU tensors,
// large graphs, or an enclosing backward restricted to some inputs (its
// bookkeeping would hide our nodes). Returns nullopt for those, when
// Config::inline_replay() is off, and on other PyTorch releases
// (TORCHLEAF_INLINE_REPLAY_SUPPORTED in capture.h).
std::optional<variable_list> replay_inline(
    const CapturedState& state,
    const edge_list& roots,
    variable_list& root_grads) {
#if !TORCHLEAF_INLINE_REPLAY_SUPPORTED
  return std::nullopt;
#else
  constexpr size_t kMaxNodes = 32;
  if (!Config::inline_replay() || torch::autograd::AnomalyMode::is_enabled()) {
    return std::nullopt;
  }
  if (const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
      exec_info != nullptr && !exec_info->empty()) {
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
  for (const auto& sink : state.input_edges) {
    if (has_hooks(*sink.function)) {
      return std::nullopt;
    }
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
    if (sink_index(state, fn) < 0 && index_of(fn) < 0) {
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
      if (fn == nullptr || sink_index(state, fn) >= 0) {
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
  torch::autograd::validate_outputs(
      roots, root_grads, [](const std::string& msg) { return msg; });
  variable_list results(state.input_edges.size());
  auto deliver = [&](const Edge& edge, at::Tensor grad) {
    if (auto s = sink_index(state, edge.function.get()); s >= 0) {
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
    torch::autograd::validate_outputs(
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
#endif
}

} // namespace

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
    const bool keep_graph = torch::autograd::get_current_graph_task_id() == -1 ||
        torch::autograd::get_current_graph_task_keep_graph();
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
        results = torch::autograd::Engine::get_default_engine().execute(
            roots,
            root_grads,
            keep_graph,
            /*create_graph=*/false,
            /*accumulate_grad=*/false,
            state.input_edges);
      }
    } catch (c10::Error& e) {
      name_the_leaf(e, "backward", *state.entry);
      throw;
    } catch (const std::exception&) {
      // A Python exception (an autograd.Function's backward): the bindings
      // add the note that eager real functions get in Python.
      detail::note_foreign_error("raised inside the backward of leaf function '" +
                                 state.entry->name + "'");
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
      // or be a tensor the captured graph holds; it gets its own copy.
      if (out[i].use_count() > 1 ||
          (out[i].has_storage() && out[i].storage().use_count() > 1)) {
        out[i] = out[i].clone();
      }
    } else {
      // The fake cannot show which inputs are used, so traced backward
      // graphs expect a tensor for every differentiable input.
      out[i] = state.input_edges[i].function->input_metadata(0).zeros_like();
    }
  }
  return out;
}

void attach_to_caller(
    const LeafEntry& entry,
    const CapturedState& state,
    const edge_list& caller_edges,
    const TensorList& captured_inputs,
    TensorList& outputs) {
  TORCH_INTERNAL_ASSERT(caller_edges.size() == state.input_edges.size());
  // The captured graph now leads straight into the caller's graph; the sinks
  // stay only where saved inputs refer to them, and where the function put
  // a hook on its input (x.register_hook): gradients then pass through the
  // active sink, whose hooks the engine runs.
  for (const auto& [edge, input] : state.sink_uses) {
    if (!has_hooks(*state.input_edges[input].function)) {
      *edge = caller_edges[input];
    }
  }
  for (const auto& sink : state.input_edges) {
    static_cast<InputSink*>(sink.function.get())->activate();
  }
  bool all_reached = true;
  for (bool reached : state.input_reached) {
    all_reached = all_reached && reached;
  }
  if (all_reached) {
    // The common case: the outputs keep their captured graph edges, which
    // costs nothing in backward.
    return;
  }
  edge_list router_edges(state.output_edges.begin(), state.output_edges.end());
  std::vector<InputMeta> zero_meta;
  for (size_t i = 0; i < caller_edges.size(); ++i) {
    if (!state.input_reached[i]) {
      router_edges.push_back(caller_edges[i]);
      const auto& t = captured_inputs[i];
      zero_meta.push_back(InputMeta{t.sym_sizes().vec(), t.options()});
    }
  }
  auto router = c10::make_intrusive<LeafRouter>(entry.shared_from_this(), std::move(zero_meta));
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
      torch::autograd::set_history(outputs[k], router);
    } else {
      router->add_input_metadata(Node::undefined_input());
    }
  }
}

} // namespace torchleaf
