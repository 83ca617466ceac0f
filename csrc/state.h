#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SafePyObject.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <vector>

#include "registry.h"

namespace torchleaf {

// Metadata of one differentiable input, enough to build a zero gradient.
struct InputMeta {
  std::vector<c10::SymInt> sizes;
  at::TensorOptions options;
};

// The autograd graph that one call of a real function built, reduced to what
// backward needs: where gradients enter (one edge per output) and where they
// leave (one edge per differentiable input). Holding the output edges keeps
// the graph and its saved tensors alive; nothing else refers to it.
// Counts live CapturedStates (torchleaf::live_states()).
struct LiveStateCounter {
  LiveStateCounter();
  ~LiveStateCounter();
  LiveStateCounter(const LiveStateCounter&) = delete;
  LiveStateCounter& operator=(const LiveStateCounter&) = delete;
};

struct CapturedState {
  LiveStateCounter counted;
  // The leaf that made it (shared: a Python leaf may be deleted while
  // graphs of its calls are alive).
  LeafEntryPtr entry;
  std::vector<torch::autograd::Edge> output_edges; // invalid: no gradient
  // The call's input sink (nodes.h), once an input is captured: input i of
  // the node stands for captured input i, and its input metadata (the
  // input's sizes, dtype and device) gives a zero gradient where nothing
  // flows.
  decltype(torch::autograd::Edge::function) sink; // (torch_private::NodePtr)
  // One per captured input: (sink, i).
  std::vector<torch::autograd::Edge> input_edges;
  // Whether any output's graph reaches input i (parallel to input_edges).
  // (Inline capacity: a state is made on every step; each heap block is a
  // malloc and a free on the hot path.)
  c10::SmallVector<bool, 8> input_reached;
  // Inputs that the function got as they are, not as an alias: leaf
  // tensors (parameters), whose AccumulateGrad the function's graph reaches
  // directly, as the plain function's does -- no alias, autograd metadata
  // or Python object per parameter and call. In an eager call they are not
  // captured inputs (the graph stays connected to their AccumulateGrad, and
  // the sink has no input for them: sink_input is kNoSinkInput); in a call
  // captured for replay the walk rewires the graph's edges to their
  // AccumulateGrad into sink input `sink_input`, so that the replay returns
  // their gradients (and the graph holds no edge of the caller's).
  // `reached`: whether an output's graph reaches it.
  static constexpr uint32_t kNoSinkInput = UINT32_MAX;
  struct PassedThrough {
    const c10::TensorImpl* tensor;
    bool reached;
    uint32_t sink_input;
  };
  c10::SmallVector<PassedThrough, 4> passed_through;
  // passed_through by tensor, for the walk, which asks for every edge to a
  // leaf: an open-addressing table of positions + 1 (0: empty), its size a
  // power of two at least twice the entries (nodes.cpp).
  c10::SmallVector<uint32_t, 8> passed_through_table;
  // Every edge of the captured graph (node edges and output edges) that
  // leads to an input sink, with that input's index: eager calls rewire them
  // to the caller's graph.
  c10::SmallVector<std::pair<torch::autograd::Edge*, size_t>, 4> sink_uses;
  // Set when autograd recorded the forward that made this state (inputs
  // requiring grad below a torch.func grad transform): the node that
  // refuses backward through its outputs. backward links the gradients it
  // computes to it, so that differentiating them raises instead of
  // silently missing a second derivative.
  torch::autograd::Edge refused_outer;
};

// Returns the handle that owns `state`: a 0-dim int64 CPU tensor whose
// storage holds the state. The state is released when the handle's storage
// is freed, so it lives exactly as long as the autograd graph that saved it.
//
// Saved-tensor hooks (offloading, torch.autograd.graph.saved_tensors_hooks)
// may replace the saved handle by a copy, whose storage is not the
// handle's. When such hooks are active at forward time, the state is also
// kept under the handle's value until a backward that does not retain the
// graph consumed it (release_after_backward), so that a copy finds it.
at::Tensor make_state_handle(std::shared_ptr<CapturedState> state);

// Whether the saved-tensor pack hook `pack_hook` (a Python callable) may
// save a copy of a tensor it packs, rather than the tensor itself or
// nothing (activation checkpointing's hooks save nothing and recompute, or
// keep the tensor itself). A state is kept for copies only when the active
// hook may make one. Without a check set (no Python bindings), every hook
// may.
using SavedHookMayCopy = bool (*)(const c10::SafePyObject& pack_hook);
TORCHLEAF_API void set_saved_hook_may_copy(SavedHookMayCopy check);

// The state of `handle` (the handle itself, or a copy of one made while
// saved-tensor hooks were active), which `entry`'s forward made; a clear
// error naming the leaf when `handle` is neither, its state is gone, or it
// belongs to another leaf.
std::shared_ptr<CapturedState> lookup_state(
    const at::Tensor& handle,
    const LeafEntry& entry);

// The same for a backward that has only its leaf's id: the state that the
// handle itself holds names its leaf (and keeps the leaf's entry alive), so
// the registry is asked only when that is not the leaf `leaf`, or the handle
// is a copy or a stacked handle, or it is not a handle at all (errors name
// the leaf from the registry).
std::shared_ptr<CapturedState> lookup_state(
    const at::Tensor& handle,
    int64_t leaf);

// One handle of shape [N, *S] for N handles of shape S (each a handle, or a
// view of one that this function made): element i of the result names the
// state that element of handles[i] names. A per-sample loop under vmap
// (torch.func) returns it as its batched state handle, so that each
// sample's backward finds its own state through lookup_state.
TORCHLEAF_API at::Tensor stack_state_handles(at::TensorList handles);

// Called by the owner of `handle` that keeps the handle itself (an autograd
// node's member, which saved-tensor hooks never see): forgets the state kept
// for copies, which would otherwise outlive every backward that never runs
// (a forward whose outputs are dropped, activation checkpointing's
// recomputation, whose outputs are).
void held_by_its_handle_alone(const at::Tensor& handle);

// Called by backward after replaying `handle`'s state: forgets a state kept
// for copies when the running backward does not retain the graph.
void release_after_backward(const at::Tensor& handle);

// True for a handle that holds a real value (not a fake, meta or functional
// tensor seen while tracing).
bool is_concrete_handle(const at::Tensor& handle);

int64_t live_state_count();

} // namespace torchleaf
