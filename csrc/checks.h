#pragma once

// The checks of a real call that are not about gradients (escapes.h has
// those): what the function may do to its inputs, what it must return, and
// its fake implementation's agreement with it (also running the fake).

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "registry.h"

namespace torchleaf {

// Adds "while running the <what> of leaf function '<name>'" to an error
// from user code (torchleaf's own errors name the leaf already).
void name_the_leaf(c10::Error& e, const char* what, const LeafEntry& entry);

// Whether `a` and `b` share storage. is_alias_of compares storages; sparse
// tensors have none (their indices and values are tensors of their own),
// and count as not aliased.
bool aliases(const at::Tensor& a, const at::Tensor& b);

// t._version() of a tensor that has a version counter (not an inference
// tensor), read from its TensorImpl: _version() takes three calls through
// autograd's VariableHooks, and a call with a module argument reads each
// parameter's version four times.
inline uint32_t version_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->version_counter().current_version();
}

// "input 2 (argument 'buf')" where the leaf can name its inputs (Python
// leaves), else "input 2 (flattened position)".
std::string describe_input(const LeafEntry& entry, int64_t plan, size_t i);

// torch.jit.trace records the operations it sees: those of the body, on the
// call's own tensors, which it would bake in as constants (a trace that
// returns the traced inputs' results whatever it is given). Refused.
void refuse_jit_tracing(const LeafEntry& entry);

// One tensor passed both as an input the function reads and as one it
// mutates: the read would see the mutation here but not in a compiled
// graph, which mutates a copy. Refused before the function runs.
void check_read_and_mutated_disjoint(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs);

// After the function ran: no input that is not declared mutable changed
// version (`versions`: each input's version before the call; inference
// tensors have none and are skipped).
void check_undeclared_mutation(
    const LeafEntry& entry,
    int64_t plan,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    c10::ArrayRef<uint32_t> versions);

// A declared in-place change computed from tensors that require grad gave
// the input's alias (`inner`) a history; the caller's tensor gets the new
// data but not that history (a leaf's backward is its outputs'), so the
// gradient of what the change was computed from would be lost. An error
// unless the leaf turned the escaped-gradients check off.
void check_mutation_without_history(
    const LeafEntry& entry,
    const TensorList& inner,
    c10::ArrayRef<bool> mutable_inputs);

// Every output of the real function is a tensor.
void check_outputs_defined(const LeafEntry& entry, const TensorList& outputs);

// Runs the fake on `inputs` and compares its outputs with the real
// function's (`real`): count, definedness, shapes, dtypes, devices.
// site.result (the real description) reaches the fake.
void validate_against_fake(
    const LeafEntry& entry,
    const TensorList& inputs,
    const TensorList& real,
    CallSite& site);

} // namespace torchleaf
