// Running a leaf's real function: run_real and its capturing variants, as a
// sequence of named steps (see run below).

#include "capture.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <optional>

#include <torchleaf/errors.h>

#include "checks.h"
#include "detach.h"
#include "escapes.h"
#include "nodes.h"
#include "profiler_range.h"
#include "torch_private.h"
#include "user_code_keys.h"

namespace torchleaf {

using torch::autograd::Edge;

namespace {

// What a real call does with autograd.
enum class Capture {
  // Nothing to capture: no input is differentiable.
  kNone,
  // The graph the function builds is captured for a later replay
  // (torchleaf::forward).
  kForReplay,
  // The graph is captured to be attached to an eager caller's graph.
  kForCaller,
};

// One real call as it goes through the steps below.
struct RealCall {
  const LeafEntry& entry;
  const TensorList& inputs;
  c10::ArrayRef<bool> mutable_inputs;
  CallSite& site;
  Capture capture;
  // kForReplay, kForCaller: the graph being captured.
  std::shared_ptr<CapturedState> state{};
  // The function's inputs: detached aliases that see the caller's data and
  // version counters but not the caller's graph.
  TensorList inner{};
  // Each input's version before the call (0 for inference tensors).
  c10::SmallVector<uint32_t, 8> versions{};
  // The calling thread's next node sequence number before the function ran.
  uint64_t first_sequence_nr = 0;
};

bool selects_any(c10::ArrayRef<bool> mask) {
  return std::find(mask.begin(), mask.end(), true) != mask.end();
}

// Which differentiable inputs the function gets as they are: leaf tensors
// (parameters), as the plain function gets them. In an eager call the
// function's graph then accumulates their gradients itself; a call captured
// for replay gives each a sink input all the same (alias_inputs), and the
// walk rewires the graph's edges to it. Not an input declared
// mutable (a leaf that requires grad cannot change in place; its alias can),
// nor the second of one tensor passed twice (its alias keeps the inputs
// apart). Records them in state.passed_through; returns a flag per input.
InputFlags select_passed_through(
    RealCall& call,
    c10::ArrayRef<bool> capture_mask) {
  const auto& inputs = call.inputs;
  InputFlags through(inputs.size(), false);
  size_t leaves = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool is_mutable =
        !call.mutable_inputs.empty() && call.mutable_inputs[i];
    // (requires_grad: a compiled graph's forward runs without grad mode, and
    // its intermediate values, which are leaves then, are captured as
    // differentiable all the same; they need an alias that does.)
    if (capture_mask[i] && !is_mutable && inputs[i].defined() &&
        inputs[i].requires_grad() && inputs[i].is_leaf()) {
      through[i] = true;
      ++leaves;
    }
  }
  if (leaves == 0) {
    return through;
  }
  reserve_passed_through(*call.state, leaves);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (through[i]) {
      through[i] =
          add_passed_through(*call.state, inputs[i].unsafeGetTensorImpl());
    }
  }
  return through;
}

// Step 1: the tensors the function sees. A captured input's alias leads
// into the state's sink (which forwards to the input's edge in the caller's
// graph once attached, kForCaller), unless the input is passed through as
// it is (select_passed_through; for replay it still takes its place among
// the sink's inputs); any other input's is a plain detached alias.
void alias_inputs(RealCall& call, c10::ArrayRef<bool> capture_mask) {
  const auto& inputs = call.inputs;
  call.inner.reserve(inputs.size());
  call.versions.reserve(inputs.size());
  const bool for_caller = call.capture == Capture::kForCaller;
  InputFlags through;
  if (call.capture != Capture::kNone) {
    through = select_passed_through(call, capture_mask);
  }
  size_t passed = 0; // (passed_through is in input order)
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    TORCHLEAF_CHECK(
        t.defined(),
        call.entry.name,
        "received an undefined tensor at input ",
        i);
    if (!through.empty() && through[i]) {
      if (!for_caller) {
        call.state->passed_through[passed].sink_input =
            add_sink_input(t, *call.state);
      }
      ++passed;
      call.inner.push_back(t);
    } else if (call.capture != Capture::kNone && capture_mask[i]) {
      if (for_caller) {
        const auto caller_edge = torch_private::gradient_edge(t);
        call.inner.push_back(sink_alias(t, *call.state, &caller_edge));
      } else {
        call.inner.push_back(sink_alias(t, *call.state));
      }
    } else {
      call.inner.push_back(detached(t));
    }
    // Inference tensors have no version counter (and cannot be changed in
    // place outside inference mode).
    call.versions.push_back(t.is_inference() ? 0 : version_of(t));
  }
}

// Step 2: the user's function, its errors named after the leaf.
TensorList call_function(RealCall& call) {
  call.first_sequence_nr = torch_private::next_sequence_nr();
  try {
    return call.entry.real(call.inner, call.site);
  } catch (c10::Error& e) {
    name_the_leaf(e, "real function", call.entry);
    throw;
  }
}

// Step 3: what the function did to its inputs and what it returned.
void check_call(RealCall& call, const TensorList& outputs) {
  const auto& entry = call.entry;
  check_undeclared_mutation(
      entry, call.site.plan, call.inputs, call.mutable_inputs, call.versions);
  check_mutation_without_history(entry, call.inner, call.mutable_inputs);
  check_outputs_defined(entry, outputs);
  if (entry.validate_outputs()) {
    validate_against_fake(entry, call.inner, outputs, call.site);
  }
}

// Step 4 (capturing calls): the captured graph's output edges, and its walk
// (escape analysis, which inputs are reached).
void finish_capture(RealCall& call, TensorList& outputs) {
  auto& state = *call.state;
  state.output_edges.reserve(outputs.size());
  for (const auto& out : outputs) {
    state.output_edges.push_back(
        out.requires_grad() ? torch_private::gradient_edge(out) : Edge());
  }
  walk_captured_graph(
      call.entry,
      call.site.plan,
      state,
      call.inner,
      call.first_sequence_nr,
      call.entry.check_escaped_gradients());
  if (call.capture == Capture::kForCaller) {
    // An output computed only from escaped tensors lost its edge; eager
    // outputs keep their own history otherwise, which would still lead
    // there.
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!state.output_edges[i].is_valid() && outputs[i].requires_grad()) {
        outputs[i] = detached(outputs[i]);
      }
    }
  }
}

// Whether something besides the call still holds `out`, for a caller that
// owns its outputs.
bool held_elsewhere(const CallSite& site, const at::Tensor& out) {
  if (!site.outputs_held.has_value()) {
    return out.use_count() > 1;
  }
  const auto& held = *site.outputs_held;
  return !site.outputs_as_returned &&
      std::find(held.begin(), held.end(), out.unsafeGetTensorImpl()) !=
      held.end();
}

// Step 5 (calls whose outputs a graph owns: all but kForCaller, where
// attach_to_caller decides): outputs without autograd history, and copies
// of those that something else holds.
void own_outputs(RealCall& call, TensorList& outputs) {
  // Without capture no input requires grad, so an output that does was
  // computed from a tensor the function reached otherwise (a closure, a
  // global): its gradient would be dropped, which the escaped-gradients
  // check reports as it does when inputs require grad.
  const bool report_escaped =
      call.capture == Capture::kNone && call.entry.check_escaped_gradients();
  for (auto& out : outputs) {
    if (out.requires_grad()) {
      // (A leaf tensor made inside the function has no history to lose.)
      if (report_escaped && out.grad_fn() != nullptr) {
        throw_escaped_output(call.entry, call.site.plan, call.inner);
      }
      out = detached(out);
    }
    // A graph owns its operators' outputs: Inductor reuses a dead output's
    // buffer for an in-place kernel. An output that something else still
    // holds -- the captured graph saved it for backward (tanh, exp,
    // sigmoid do), it is a global, a cache or a module attribute, or a
    // view of one, or another output -- would be corrupted by that, so
    // the graph gets a copy. (A tensor made in Python keeps a reference
    // from its PyObject: Python leaves say which outputs are held. Their
    // eager calls take the outputs as returned (CallSite::
    // outputs_as_returned), as the plain function does; an output that
    // copy_aliased_outputs replaced is no longer the held one.)
    if (held_elsewhere(call.site, out) ||
        (out.has_storage() && out.storage().use_count() > 1 &&
         !torch_private::is_view_of_unheld_base(out))) {
      out = out.clone();
    }
  }
}

// The steps of every real call. `capture_mask` selects the differentiable
// inputs (unless kNone).
TensorList run(RealCall& call, c10::ArrayRef<bool> capture_mask) {
  const auto& entry = call.entry;
  const ProfilerRange range(entry.name);
  refuse_jit_tracing(entry);
  const bool capturing = call.capture != Capture::kNone;
  if (capturing) {
    call.state = std::make_shared<CapturedState>();
    call.state->entry = entry.shared_from_this();
  }
  UserCodeKeysGuard keys(capturing || !c10::InferenceMode::is_enabled());
  std::optional<at::AutoGradMode> grad_mode;
  if (capturing) {
    grad_mode.emplace(true);
  }
  alias_inputs(call, capture_mask);
  check_read_and_mutated_disjoint(entry, call.inputs, call.mutable_inputs);
  TensorList outputs = call_function(call);
  check_call(call, outputs);
  copy_aliased_outputs(outputs, call.inner);
  if (capturing) {
    finish_capture(call, outputs);
  }
  if (call.capture != Capture::kForCaller) {
    own_outputs(call, outputs);
  }
  // The outputs as the caller gets them (copies included) against what the
  // fake gave when a graph of this call was traced, if one was.
  entry.fake_outputs.check(entry, call.site.plan, call.inputs, outputs);
  return outputs;
}

} // namespace

TensorList run_real(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site) {
  RealCall call{entry, inputs, mutable_inputs, site, Capture::kNone};
  return run(call, {});
}

CapturedCall run_real_captured(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site,
    c10::ArrayRef<bool> capture_mask) {
  TORCH_INTERNAL_ASSERT(capture_mask.size() == inputs.size());
  RealCall call{
      entry,
      inputs,
      mutable_inputs,
      site,
      selects_any(capture_mask) ? Capture::kForReplay : Capture::kNone};
  auto outputs = run(call, capture_mask);
  return {std::move(outputs), std::move(call.state)};
}

TensorList run_real_attached(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site,
    c10::ArrayRef<bool> capture_mask) {
  TORCH_INTERNAL_ASSERT(
      capture_mask.size() == inputs.size() && selects_any(capture_mask));
  RealCall call{entry, inputs, mutable_inputs, site, Capture::kForCaller};
  auto outputs = run(call, capture_mask);
  attach_to_caller(entry, *call.state, outputs);
  return outputs;
}

} // namespace torchleaf
