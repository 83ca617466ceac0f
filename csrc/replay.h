#pragma once

// Backpropagation through a captured graph (replay.cpp), and the inline
// replay of small CPU graphs (replay_inline.cpp) that it tries first.

#include <ATen/core/Tensor.h>
#include <c10/core/SafePyObject.h>
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <memory>
#include <optional>
#include <vector>

#include <torchleaf/export.h>

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

// Backpropagates `grads` (one per output; nullopt/undefined: no gradient)
// through `state`'s graph and returns one gradient per captured input, zeros
// where nothing flows. Never frees the graph.
TensorList replay(
    const CapturedState& state,
    const std::vector<std::optional<at::Tensor>>& grads);

// Whether running `fn` can never run Python code: PyTorch's derivative
// formulas and torchleaf's own nodes. A replay of such nodes only leaves
// PyTorch's stashed Python context in place (PythonContextSetAside); any
// other node (an autograd.Function's, a compiled function's backward, a C++
// extension's) counts as Python.
TORCHLEAF_API bool runs_without_python(const torch::autograd::Node& fn);

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
  PythonContextSetAside();
  ~PythonContextSetAside();
  PythonContextSetAside(const PythonContextSetAside&) = delete;
  PythonContextSetAside& operator=(const PythonContextSetAside&) = delete;

 private:
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
// (TORCHLEAF_INLINE_REPLAY_SUPPORTED above).
#if TORCHLEAF_INLINE_REPLAY_SUPPORTED
std::optional<torch::autograd::variable_list> replay_inline(
    const CapturedState& state,
    const torch::autograd::edge_list& roots,
    torch::autograd::variable_list& root_grads);
#else
inline std::optional<torch::autograd::variable_list> replay_inline(
    const CapturedState& /*state*/,
    const torch::autograd::edge_list& /*roots*/,
    torch::autograd::variable_list& /*root_grads*/) {
  return std::nullopt;
}
#endif

} // namespace torchleaf
