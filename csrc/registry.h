#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torchleaf/export.h>
#include <torchleaf/leaf.h>

#include "output_check.h"

namespace torchleaf {

// What one call hands a leaf's implementation besides its tensors, and what
// the implementation hands back. It lives on the caller's stack for exactly
// one call, so nothing a call produces can be seen by another call.
struct CallSite {
  // Which call structure of the leaf this is (Python leaves: an index into
  // the leaf's call plans, baked into traced graphs); 0 for C++ leaves.
  int64_t plan = 0;
  // The frontend's own payload for its implementation of the leaf: owned by
  // the frontend that made the call (the Python bindings: a borrowed
  // PyObject*, the eager call's non-tensor arguments) for the call's
  // duration. Opaque to the core, which only hands it to the leaf's real and
  // fake implementations. nullptr for calls from a graph, whose
  // implementation rebuilds everything from `plan` and the tensors.
  void* frontend_payload = nullptr;
  // Set by the caller when it takes the outputs as the function returned
  // them (an eager call, whose outputs no graph owns): the core then copies
  // no output because something else holds it (aliases of inputs and of
  // other outputs are still copied).
  bool outputs_as_returned = false;
  // Set by the real implementation: a description of its outputs that the
  // caller receives with them (Python leaves: the output pytree), and that
  // output validation passes on to the fake implementation.
  std::shared_ptr<void> result{};
  // Set by a real implementation that can tell which of its outputs
  // something besides the call still holds (Python leaves: a global, a cache
  // or a module attribute holds its PyObject): those outputs. Unset: the
  // core counts each output's references, which is exact for tensors that
  // only C++ holds.
  std::optional<c10::SmallVector<const c10::TensorImpl*, 4>> outputs_held{};
};

// One flag per flat input of a call (mutable, captured), with inline room
// for a typical call: a heap block per call would be a malloc and a free on
// every step.
using InputFlags = c10::SmallVector<bool, 8>;

// The form in which the core calls a leaf's real and fake implementations.
using LeafImpl = std::function<TensorList(const TensorList&, CallSite&)>;

// Everything torchleaf knows about one leaf function: one entry per leaf,
// C++ or Python. C++ leaves live as long as the process (their named
// operators do); a Python leaf's entry is removed when its Python function
// dies, and calls in flight keep it alive through shared ownership.
struct TORCHLEAF_API LeafEntry : std::enable_shared_from_this<LeafEntry> {
  // The id graphs refer to. PyTorch's on-disk compilation caches may reuse a
  // graph compiled in another process, so an id must mean the same leaf in
  // every process or in none: C++ leaves take a hash of their name (the same
  // library defines the same leaf), Python leaves a per-process random prefix
  // plus a counter that never repeats (a dead leaf's id names nothing).
  int64_t id = -1;
  // "ns::name" for C++ leaves; the Python qualname for Python leaves.
  std::string name;
  LeafImpl real;
  LeafImpl fake; // empty: tracing fails with "requires a fake implementation"
  // Python leaves: how the caller wrote flat input `index` of a call of
  // `plan` ("argument 'x'", "argument 'model.weight'"), for error messages;
  // an empty string when it cannot say. Unset for C++ leaves, whose inputs
  // are their positions. Called only when an error is raised.
  std::function<std::string(int64_t plan, size_t index)> input_name;
  LeafOptions options;
  // C++ leaves: their named operator `name`, and the fragment that defines it
  // (kept alive so the registration stays in place). Python leaves go through
  // the generic torchleaf::call operator.
  std::optional<c10::OperatorHandle> named_op;
  std::unique_ptr<torch::Library> library;
  // What the fake returned when traced calls were traced, checked against
  // every real call's outputs (output_check.h). Mutable: filled in as graphs
  // are traced, with its own lock.
  mutable FakeOutputRecords fake_outputs;

  bool has_named_op() const {
    return named_op.has_value();
  }
  bool validate_outputs() const;
  bool check_escaped_gradients() const;
  bool mutates(size_t flat_position) const;
  // Fails with a clear error when the leaf declares its arity
  // (LeafOptions::inputs) and a call brings `received` tensors instead.
  void check_input_count(size_t received) const;
};

using LeafEntryPtr = std::shared_ptr<const LeafEntry>;

// Internal API, exported for the Python bindings.

// The id the named leaf `name` gets (a hash of the name).
TORCHLEAF_API int64_t named_leaf_id(const std::string& name);

// ("ns", "name") of "ns::name"; a clear error when either part is not an
// identifier.
TORCHLEAF_API std::pair<std::string, std::string> split_qualified_name(
    const std::string& qualified_name);

// Fails with "already defined" when a named leaf `name` exists.
TORCHLEAF_API void check_name_free(const std::string& name);

// Publishes `entry` (its id is assigned here for unnamed leaves) and returns
// its id. Named entries must be complete (operator defined) when published.
TORCHLEAF_API int64_t register_leaf(std::shared_ptr<LeafEntry> entry);

// Removes an unnamed (Python) leaf; graphs that still name it then fail with
// a clear error. Calls in flight finish with the entry they hold.
TORCHLEAF_API void unregister_leaf(int64_t id);

// The entry for `id`; a clear error when there is none.
TORCHLEAF_API LeafEntryPtr get_leaf(int64_t id);

// The entry for `id`, or nullptr when there is none.
TORCHLEAF_API LeafEntryPtr find_leaf(int64_t id);

// The entry whose name is `name`, or nullptr.
TORCHLEAF_API LeafEntryPtr find_leaf_entry(const std::string& name);

// Entries of all leaves that own a named operator, in definition order.
TORCHLEAF_API std::vector<LeafEntryPtr> named_leaves();

// Number of registered leaves (named and unnamed).
TORCHLEAF_API size_t leaf_count();

} // namespace torchleaf
