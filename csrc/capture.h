#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <memory>
#include <optional>
#include <vector>

#include "registry.h"
#include "state.h"

// replay's inline path (capture.cpp) re-implements the slice of
// torch::autograd::Engine::execute that a small CPU graph needs, on engine
// internals with no stability promise: InputBuffer's accumulation and
// signature, validate_outputs, what a graph task's exec_info means, which
// hooks a Node can carry. It is verified against PyTorch 2.13 only
// (tests/cpp/test_replay.cpp compares it with the engine); built against any
// other release, it is compiled out and every replay uses the engine, which
// is always right.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
#define TORCHLEAF_INLINE_REPLAY_SUPPORTED 1
#else
#define TORCHLEAF_INLINE_REPLAY_SUPPORTED 0
#endif

namespace torchleaf {

// Runs `entry`'s real function on `inputs` (flat order; `mutable_inputs[i]`
// says whether input i may be mutated in place, empty: none) and checks the
// call (undeclared mutation, optional output validation). Outputs never
// alias inputs and carry no autograd history, except for eager callers
// (`caller_edges`), whose outputs keep the captured graph's history for
// attach_to_caller.
//
// With a `capture_mask` (empty: none) that selects at least one input, the
// function runs under grad mode on aliases of the selected inputs that are
// cut off from the caller's graph, and the graph it builds is returned in
// `*state`. Eager callers pass `caller_edges` (one per selected input) for
// attach_to_caller.
//
// `site` carries the call's plan and arguments to the implementation, and
// receives its output description.
TensorList run_real(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    CallSite& site,
    c10::ArrayRef<bool> capture_mask = {},
    std::shared_ptr<CapturedState>* state = nullptr,
    const torch::autograd::edge_list* caller_edges = nullptr);

// Runs `entry`'s fake function, or fails with "requires a fake implementation".
TensorList run_fake(const LeafEntry& entry, const TensorList& inputs, CallSite& site);

// Replaces each output that aliases an input or an earlier output by a copy:
// an operator's outputs are its own. Real calls (run_real) and fake ones
// (call_fake: a fake that returns one tensor twice, `(torch.empty_like(x),)
// * 3`, would tell a graph that the outputs share memory, and it would read
// one output's values for another) alike.
void copy_aliased_outputs(TensorList& outputs, const TensorList& inputs);

// Backpropagates `grads` (one per output; nullopt/undefined: no gradient)
// through `state`'s graph and returns one gradient per captured input, zeros
// where nothing flows. Never frees the graph.
TensorList replay(
    const CapturedState& state,
    const std::vector<std::optional<at::Tensor>>& grads);

// Whether running `fn` can never run Python code: PyTorch's derivative
// formulas and torchleaf's own nodes. A replay of such nodes only leaves
// PyTorch's stashed Python context in place (see PythonContextSetAside in
// capture.cpp); any other node (an autograd.Function's, a compiled
// function's backward, a C++ extension's) counts as Python.
TORCHLEAF_API bool runs_without_python(const torch::autograd::Node& fn);

// Eager mode: connects a captured call straight into the caller's graph, so
// that backward runs the captured graph as part of the caller's backward (no
// replay, no handle): each input sink forwards to `caller_edges[i]`, the
// caller's edge for captured input i, and the outputs keep the captured
// graph's edges. When some input is not reached, the outputs instead get one
// node named after the leaf that routes gradients into the captured graph and
// gives those inputs zeros. Retain_graph and create_graph behave exactly as
// for any autograd graph.
void attach_to_caller(
    const LeafEntry& entry,
    const CapturedState& state,
    const torch::autograd::edge_list& caller_edges,
    const TensorList& captured_inputs,
    TensorList& outputs);

} // namespace torchleaf
