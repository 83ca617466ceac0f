// The torchleaf operators: their schemas and which kernels they run.

#include <torch/library.h>

#include "../state.h"
#include "kernel_wiring.h"
#include "kernels.h"
#include "leaf_ops.h"

namespace torchleaf::ops {

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
  def("forward(int leaf, int plan, Tensor[] inputs, int[] differentiable) "
      "-> (Tensor[], Tensor)",
      capturing_tags);
  def("call_mutating(int leaf, int plan, Tensor[] inputs, Tensor(a!)[] mutated) "
      "-> Tensor[]",
      tags);
  def("forward_mutating(int leaf, int plan, Tensor[] inputs, "
      "Tensor(a!)[] mutated, int[] differentiable) -> (Tensor[], Tensor)",
      capturing_tags);
  def("call_functional(int leaf, int plan, Tensor[] inputs, Tensor[] mutated) "
      "-> (Tensor[], Tensor[])",
      tags);
  def("forward_functional(int leaf, int plan, Tensor[] inputs, "
      "Tensor[] mutated, int[] differentiable) -> (Tensor[], Tensor, Tensor[])",
      capturing_tags);
  // Inductor passes backward's gradients contiguous: a loss's gradient is
  // often an expand (stride 0), which a fused kernel then writes once,
  // where the replayed aten ops would each copy it for a dense operand (mm
  // does, once per product). Other backends and eager pass them as they are.
  auto backward_tags = tags;
  backward_tags.push_back(at::Tag::needs_contiguous_strides);
  def("backward(int leaf, Tensor state, Tensor?[] grads, SymInt[] input_meta) "
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
  m.def(
      "check_carried_int(str leaf, Tensor carrier, SymInt expected, bool zigzag) -> ()");
  // The same for a tensor output whose traced sizes are symbolic, which the
  // operator's always-on output check cannot see (output_check.h).
  m.def(
      "check_output_sizes(str leaf, int output, Tensor tensor, SymInt[] expected) -> ()");

  // Kernels: real, fake, autograd[, functionalize] (kernel_wiring.h). The
  // functional variants, stack_handles and the checks only ever run below
  // Autograd (in graphs, or from the kernels above).
  const auto boxed_forward_autograd = [] {
    return torch::CppFunction::makeFromBoxedFunction<
        &forward_autograd_kernel>();
  };
  register_leaf_kernels(
      m, "call", &call_kernel, &call_meta, &call_autograd_kernel);
  register_leaf_kernels(
      m,
      "call_mutating",
      &call_mutating_kernel,
      &call_mutating_meta,
      &call_mutating_autograd_kernel,
      &call_mutating_functionalize);
  register_leaf_kernels(
      m,
      "forward",
      &forward_kernel,
      &forward_meta,
      &forward_unboxed_autograd_kernel);
  register_leaf_kernels(
      m,
      "forward_mutating",
      &forward_mutating_kernel,
      &forward_mutating_meta,
      boxed_forward_autograd(),
      &forward_mutating_functionalize);
  register_leaf_kernels(
      m,
      "call_functional",
      &call_functional_kernel,
      &call_functional_meta,
      NoKernel{});
  register_leaf_kernels(
      m,
      "forward_functional",
      &forward_functional_kernel,
      &forward_functional_meta,
      boxed_forward_autograd());
  register_leaf_kernels(
      m,
      "backward",
      &backward_kernel,
      &backward_meta,
      &backward_autograd_kernel);
  register_leaf_kernels(
      m,
      "stack_handles",
      &stack_state_handles,
      &stack_handles_meta,
      NoKernel{});
  register_leaf_kernels(
      m,
      "check_carried_int",
      &check_carried_int_kernel,
      &check_carried_int_meta,
      NoKernel{});
  register_leaf_kernels(
      m,
      "check_output_sizes",
      &check_output_sizes_kernel,
      &check_output_sizes_meta,
      NoKernel{});
}

} // namespace torchleaf::ops
