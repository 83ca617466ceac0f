// The torchleaf operators' schemas and the registration of their kernels.

#include <torch/library.h>

#include "../state.h"
#include "kernels.h"
#include "leaf_ops.h"

namespace torchleaf::ops {

TORCH_LIBRARY_IMPL(torchleaf, Functionalize, m) {
  m.impl("call_mutating", &call_mutating_functionalize);
  m.impl("forward_mutating", &forward_mutating_functionalize);
}

TORCH_LIBRARY(torchleaf, m) {
  const auto tags = leaf_operator_tags();
  // (A string literal, or a temporary tag list, would pick def's (schema,
  // kernel) template overload.)
  auto def = [&m](const char* schema, const std::vector<at::Tag>& schema_tags) {
    m.def(schema, schema_tags);
  };
  def("call(int leaf, int plan, Tensor[] inputs) -> Tensor[]", tags);
  // The capturing operators also say that they may draw random numbers
  // (a dropout in the body): when compiled activation checkpointing
  // recomputes one in backward, AOTAutograd then saves the generator's state
  // before the forward's call and restores it around the recomputation
  // (run_and_save_rng_state / run_with_rng_state), so that the replayed
  // graph is the one whose outputs the forward returned.
  auto capturing_tags = tags;
  capturing_tags.push_back(at::Tag::nondeterministic_seeded);
  def(
      "forward(int leaf, int plan, Tensor[] inputs, int[] differentiable) "
      "-> (Tensor[], Tensor)",
      capturing_tags);
  def(
      "call_mutating(int leaf, int plan, Tensor[] inputs, Tensor(a!)[] mutated) "
      "-> Tensor[]",
      tags);
  def(
      "forward_mutating(int leaf, int plan, Tensor[] inputs, "
      "Tensor(a!)[] mutated, int[] differentiable) -> (Tensor[], Tensor)",
      capturing_tags);
  def(
      "call_functional(int leaf, int plan, Tensor[] inputs, Tensor[] mutated) "
      "-> (Tensor[], Tensor[])",
      tags);
  def(
      "forward_functional(int leaf, int plan, Tensor[] inputs, "
      "Tensor[] mutated, int[] differentiable) -> (Tensor[], Tensor, Tensor[])",
      capturing_tags);
  // Inductor passes backward's gradients contiguous: a loss's gradient is
  // often an expand (stride 0), which a fused kernel then writes once,
  // where the replayed aten ops would each copy it for a dense operand (mm
  // does, once per product). Other backends and eager pass them as they are.
  auto backward_tags = tags;
  backward_tags.push_back(at::Tag::needs_contiguous_strides);
  def(
      "backward(int leaf, Tensor state, Tensor?[] grads, SymInt[] input_meta) "
      "-> Tensor[]",
      backward_tags);
  // The batched state handle of a per-sample loop under vmap(grad(leaf))
  // (stack_state_handles). An operator, not a helper, so that a traced
  // vmap(grad(leaf)) records it: the compiled graph stacks the real handles.
  m.def("stack_handles(Tensor[] handles) -> Tensor");
  // An int output of a Python leaf, carried in compiled code as the size of
  // a zero-stride tensor, against the fake's int (`expected`, which the
  // graph computes from its inputs' sizes and uses downstream): a fake whose
  // expression is wrong is an error, not a silently returned value. (The
  // leaf by name: exported programs run in other processes.)
  m.def("check_carried_int(str leaf, Tensor carrier, SymInt expected, bool zigzag) -> ()");
  // The same for a tensor output whose traced sizes are symbolic, which the
  // operator's always-on output check cannot see (output_check.h).
  m.def("check_output_sizes(str leaf, int output, Tensor tensor, SymInt[] expected) -> ()");
}

TORCH_LIBRARY_IMPL(torchleaf, CompositeExplicitAutograd, m) {
  m.impl("call", &call_kernel);
  m.impl("forward", &forward_kernel);
  m.impl("call_mutating", &call_mutating_kernel);
  m.impl("forward_mutating", &forward_mutating_kernel);
  m.impl("call_functional", &call_functional_kernel);
  m.impl("forward_functional", &forward_functional_kernel);
  m.impl("backward", &backward_kernel);
  m.impl("stack_handles", &stack_state_handles);
  m.impl("check_carried_int", &check_carried_int_kernel);
  m.impl("check_output_sizes", &check_output_sizes_kernel);
}

TORCH_LIBRARY_IMPL(torchleaf, Meta, m) {
  m.impl("call", &call_meta);
  m.impl("forward", &forward_meta);
  m.impl("call_mutating", &call_mutating_meta);
  m.impl("forward_mutating", &forward_mutating_meta);
  m.impl("call_functional", &call_functional_meta);
  m.impl("forward_functional", &forward_functional_meta);
  m.impl("backward", &backward_meta);
  m.impl("stack_handles", &stack_handles_meta);
  m.impl("check_carried_int", &check_carried_int_meta);
  m.impl("check_output_sizes", &check_output_sizes_meta);
}

} // namespace torchleaf::ops
