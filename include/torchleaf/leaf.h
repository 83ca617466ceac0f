#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torchleaf/export.h>

// Defining and calling leaf functions from C++.
//
//   auto clip = torchleaf::define_leaf(
//       "mylib::clip_rows",
//       [](const torchleaf::TensorList& in) {          // real: anything goes
//         auto n = in[0].norm(2, 1, /*keepdim=*/true);
//         return torchleaf::TensorList{n.max().item<double>() > 1 ? in[0] / n :
//         in[0] * 1};
//       },
//       [](const torchleaf::TensorList& in) {          // fake: metadata only
//         return torchleaf::TensorList{at::empty_like(in[0])};
//       },
//       torchleaf::LeafOptions().inputs(1));
//   auto y = clip({x})[0];   // through the dispatcher; autograd works
//
// From Python: torchleaf.load_library(path), then
// torch.ops.mylib.clip_rows([x]).

namespace torchleaf {

// What a leaf takes and returns: a list of tensors (Python sees Tensor[]).
using TensorList = std::vector<at::Tensor>;

// A leaf implementation: a function from a list of tensors to a list of
// tensors. The real implementation may do anything (data-dependent control
// flow, logging, other libraries); the fake implementation must only compute
// output metadata and is called on meta or fake tensors by tracers.
using LeafFn = std::function<TensorList(const TensorList&)>;

struct TORCHLEAF_API LeafOptions {
  // Number of tensors the leaf takes (mutable ones included). When set, every
  // call (eager, through the named operator, fake/meta) with another count is
  // a clear error instead of reaching the implementation, which would index
  // past the end of its input list. Unset: any count is passed through.
  std::optional<int64_t> num_inputs;
  // Positions in the input list that the real implementation may mutate in
  // place. Any other in-place mutation of an input is an error.
  std::vector<int64_t> mutates_inputs;
  // Per-leaf override of Config::validate_outputs().
  std::optional<bool> validate_outputs;
  // Per-leaf override of Config::check_escaped_gradients().
  std::optional<bool> check_escaped_gradients;

  // Builder-style setters of the fields above:
  // LeafOptions().inputs(2).mutates({1}).validate(true).
  LeafOptions& inputs(int64_t n) {
    num_inputs = n;
    return *this;
  }
  LeafOptions& mutates(std::vector<int64_t> positions) {
    mutates_inputs = std::move(positions);
    return *this;
  }
  LeafOptions& validate(bool enabled) {
    validate_outputs = enabled;
    return *this;
  }
  LeafOptions& check_escaped(bool enabled) {
    check_escaped_gradients = enabled;
    return *this;
  }
};

struct LeafEntry;

// A defined leaf function. Calling it goes through the PyTorch dispatcher as
// the operator `namespace::name`, so tracers see one opaque node and autograd
// replays the real function's own graph in backward.
class TORCHLEAF_API LeafFunction {
 public:
  explicit LeafFunction(const LeafEntry* entry) : entry_(entry) {}

  // Calls the leaf with `inputs` (mutable ones included, in their declared
  // positions) as the operator `namespace::name`: eagerly the real function
  // runs and its own autograd graph connects the outputs to the inputs;
  // under tracers the fake runs. Throws LeafError on misuse (see errors.h).
  TensorList operator()(const TensorList& inputs) const;

  // The leaf's process-local id (what torchleaf's generic operators take).
  int64_t id() const;
  // The qualified operator name, "namespace::name".
  const std::string& name() const;

 private:
  const LeafEntry* entry_;
};

// Defines a leaf function as the operator `qualified_name` ("ns::name",
// both parts identifiers). `fake` may be empty: tracers then fail with a
// "requires a fake implementation" error, eager calls work. Throws LeafError
// when the name is taken, malformed, or in a reserved namespace (aten, prim,
// prims, torchleaf), or when `options` are inconsistent; nothing is
// registered then. Typically called from a static initializer of a shared
// library, so that loading the library defines the leaf.
TORCHLEAF_API LeafFunction define_leaf(
    const std::string& qualified_name,
    LeafFn real,
    LeafFn fake = nullptr,
    LeafOptions options = {});

// The leaf defined as `qualified_name`, if any.
TORCHLEAF_API std::optional<LeafFunction> find_leaf(
    const std::string& qualified_name);

// Number of captured autograd states alive now: one per differentiable call
// through the operators (compiled graphs, make_fx, dispatch modes, torch.func)
// whose graph has not been released yet. A plain eager call wires the body's
// graph into the caller's and keeps no state, so it never counts.
TORCHLEAF_API int64_t live_states();

} // namespace torchleaf
