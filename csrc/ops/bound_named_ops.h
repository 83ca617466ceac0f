#pragma once

// Named operators bound at run time to leaves of a host language (Python's
// @torchleaf.leaf_function(name="ns::op")): the form in which such a leaf is
// exported.
//
// A C++ leaf's named operator takes only tensors: its C++ function is the
// whole call. A host-language leaf's call also has a structure (pytree,
// constants) that its own process describes by a plan index; an exported
// program must run in another process, so the operator takes the call's
// description as a string instead:
//
//   ns::op(Tensor[] inputs, str call) -> Tensor[]
//   ns::op(Tensor[] inputs, Tensor(a!)[] mutated, str call) -> Tensor[]
//
// and the process that runs the program binds the name to a live leaf (by
// importing the module that defines it) and turns each distinct string into
// one of that leaf's plans, once.

#include <functional>
#include <string>

#include <torchleaf/export.h>

namespace torchleaf::ops {

// Turns a call description into a plan of leaf `leaf` (host-language code).
using PlanResolver =
    std::function<int64_t(int64_t leaf, const std::string& call)>;

// Makes the operator `qualified_name` call leaf `leaf` (an entry of the
// registry), defining the operator on first use. A name stays an operator
// for the life of the process (the dispatcher's handles to it must stay
// valid), but holds no leaf: once its leaf dies, calls fail with a clear
// error until another leaf binds the name. Fails when the name's current
// leaf is still alive, when it is a C++ leaf's, or when `mutating` differs
// from the operator's schema.
TORCHLEAF_API void bind_named_operator(
    const std::string& qualified_name,
    int64_t leaf,
    bool mutating,
    PlanResolver resolver);

} // namespace torchleaf::ops
