#pragma once

// Running a leaf's real function on a call's tensors (capture.cpp), with or
// without capturing the autograd graph it builds; its fake (checks.cpp); and
// connecting a captured graph to an eager caller's (attach.cpp). Replay of a
// captured graph is in replay.h.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <vector>

#include "registry.h"
#include "replay.h"
#include "state.h"

namespace torchleaf {

// The three ways to run a leaf's real function. Each runs `entry`'s real
// function on `inputs` (flat order; `mutable_inputs[i]` says whether input i
// may be mutated in place, empty: none) on aliases of the inputs cut off
// from the caller's graph, and checks the call (undeclared mutation,
// escaped gradients, optional output validation, the traced fake's outputs).
// `site` carries the call's plan and arguments to the implementation, and
// receives its output description.

// No input is differentiable (the dense kernel of every leaf operator). The
// outputs are the call's own: they never alias inputs or anything else that
// holds them (copies where needed), and carry no autograd history.
TensorList run_real(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site);

// The outputs of a capturing call, and the graph it captured (nullptr when
// nothing was captured).
struct CapturedCall {
  TensorList outputs;
  std::shared_ptr<CapturedState> state;
};

// torchleaf::forward's kernel: the function runs under grad mode with the
// inputs that `capture_mask` selects as the captured graph's inputs, and the
// graph it builds is returned with the outputs, which are as run_real's.
// The function gets leaf tensors among them that require grad (parameters)
// as they are; the graph's edges to them are rewired to the state's sink,
// so that the replay returns their gradients. When the mask selects no
// input, this is run_real (and the state nullptr).
CapturedCall run_real_captured(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site,
    c10::ArrayRef<bool> capture_mask);

// An eager differentiable call: captures as run_real_captured for the
// inputs `capture_mask` selects (at least one; they require grad), and
// attaches the captured graph to the caller's (attach_to_caller): the
// outputs keep its history. The function gets leaf tensors among them
// (parameters) as they are, not as aliases, as the plain function does:
// their gradients accumulate straight from its graph.
TensorList run_real_attached(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site,
    c10::ArrayRef<bool> capture_mask);

// Runs `entry`'s fake function, or fails with "requires a fake implementation".
TensorList run_fake(
    const LeafEntry& entry,
    const TensorList& inputs,
    CallSite& site);

// Replaces each output that aliases an input or an earlier output by a copy:
// an operator's outputs are its own. Real calls (run_real) and fake ones
// (call_fake: a fake that returns one tensor twice, `(torch.empty_like(x),)
// * 3`, would tell a graph that the outputs share memory, and it would read
// one output's values for another) alike.
void copy_aliased_outputs(TensorList& outputs, const TensorList& inputs);

// Eager mode: connects a captured call straight into the caller's graph, so
// that backward runs the captured graph as part of the caller's backward (no
// replay, no handle): the edges into the input sink now lead to the
// caller's edge of that input (the sink's next edge), and the outputs keep
// the captured graph's edges. When some input is not reached, the outputs
// instead get one node named after the leaf that routes gradients into the
// captured graph; those inputs get no gradient, as with the plain function.
// Retain_graph and create_graph behave exactly as for any autograd graph.
void attach_to_caller(
    const LeafEntry& entry,
    const CapturedState& state,
    TensorList& outputs);

} // namespace torchleaf
