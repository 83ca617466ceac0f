#pragma once

// The kernels of the torchleaf operators, as their registration
// (schema.cpp) and the direct entries (calls.cpp) see them. Not part of the
// ops API (leaf_ops.h).

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/string_view.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "../registry.h"
#include "../state.h"

namespace torchleaf::ops {

// Whether `t` carries a forward-mode AD tangent (inputs.cpp).
bool has_forward_tangent(const at::Tensor& t);

// torchleaf::forward's real work: runs the leaf capturing the inputs
// `differentiable` lists, and returns its outputs and state handle.
std::tuple<TensorList, at::Tensor> run_forward(
    LeafEntryPtr entry,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);

// torchleaf::backward's real work: replays `captured` (the state of the
// handle `state`).
TensorList run_backward(
    const CapturedState& captured,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads);

// Dense (CompositeExplicitAutograd) and Meta kernels (kernels.cpp).
TensorList call_kernel(int64_t leaf, int64_t plan, at::TensorList inputs);
TensorList call_meta(int64_t leaf, int64_t plan, at::TensorList inputs);
TensorList call_mutating_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated);
TensorList call_mutating_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated);
std::tuple<TensorList, at::Tensor> forward_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable);
std::tuple<TensorList, at::Tensor> forward_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable);
std::tuple<TensorList, at::Tensor> forward_mutating_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);
std::tuple<TensorList, at::Tensor> forward_mutating_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);
TensorList backward_kernel(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta);
TensorList backward_meta(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta);
at::Tensor stack_handles_meta(at::TensorList handles);
void check_carried_int_kernel(
    c10::string_view leaf,
    const at::Tensor& carrier,
    c10::SymInt expected,
    bool zigzag);
void check_carried_int_meta(
    c10::string_view leaf,
    const at::Tensor& carrier,
    c10::SymInt expected,
    bool zigzag);
void check_output_sizes_kernel(
    c10::string_view leaf,
    int64_t output,
    const at::Tensor& tensor,
    c10::SymIntArrayRef expected);
void check_output_sizes_meta(
    c10::string_view leaf,
    int64_t output,
    const at::Tensor& tensor,
    c10::SymIntArrayRef expected);

// The functional variants of the mutating operators and the Functionalize
// kernels that call them (functionalize.cpp).
std::tuple<TensorList, TensorList> call_functional_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated);
std::tuple<TensorList, TensorList> call_functional_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated);
std::tuple<TensorList, at::Tensor, TensorList> forward_functional_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);
std::tuple<TensorList, at::Tensor, TensorList> forward_functional_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);
std::tuple<TensorList, at::Tensor> forward_mutating_functionalize(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);

// Autograd kernels (autograd/leaf_autograd.cpp). forward_mutating and
// forward_functional take the boxed forward_autograd_kernel.
TensorList call_autograd_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs);
TensorList call_mutating_autograd_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated);
std::tuple<TensorList, at::Tensor> forward_unboxed_autograd_kernel(
    c10::DispatchKeySet keys,
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable);
void forward_autograd_kernel(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack);
TensorList backward_autograd_kernel(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta);

} // namespace torchleaf::ops
