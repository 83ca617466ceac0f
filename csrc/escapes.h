#pragma once

// Escape analysis of a captured call (escapes.cpp): gradients that would
// leave the call for tensors that are not its inputs.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

#include "registry.h"
#include "state.h"

namespace torchleaf {

// Walks the captured graph from the outputs and records which inputs the
// outputs reach and every edge that leads to an input sink
// (state.input_reached, state.sink_uses). Edges from the call's graph to
// anything outside it are escaped gradients: reported when
// `report_escaped`, and otherwise cut off, so that no gradient is computed
// for them -- the call's own edges are cut, never the caller's graph. An
// output computed from escaped tensors alone loses its edge. `inner` are the
// function's input aliases; `first_sequence_nr` the calling thread's next
// node sequence number before the function ran.
void walk_captured_graph(
    const LeafEntry& entry,
    int64_t plan,
    CapturedState& state,
    const TensorList& inner,
    uint64_t first_sequence_nr,
    bool report_escaped);

// The error for an output with autograd history from a call that captured
// nothing (none of its inputs requires grad): the body made an input
// require grad (`inner`, its input aliases, say which), or the output was
// computed from a tensor reached through a closure or a global.
[[noreturn]] void throw_escaped_output(
    const LeafEntry& entry,
    int64_t plan,
    const TensorList& inner);

// The error for inputs the body made require grad (the caller's did not).
std::string requires_grad_set_inside(
    const LeafEntry& entry,
    int64_t plan,
    c10::ArrayRef<size_t> inputs);

} // namespace torchleaf
