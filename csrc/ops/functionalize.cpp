// Functionalization of the mutating leaf operators: the functional
// variants (call_functional, forward_functional), run on clones of the
// mutable inputs, and the Functionalize kernels that call them.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "../torch_private.h"
#include "kernels.h"
#include "leaf_ops.h"

namespace torchleaf::ops {

namespace {

// Functionalization of the mutating variants (auto_functionalize does not
// handle list returns): call the functional variant on the unwrapped inputs,
// then write the new values back into the functional tensors.
TensorList unwrap(at::TensorList tensors) {
  namespace F = torch_private::functionalization;
  TensorList out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (F::isFunctionalTensor(t)) {
      F::sync(t);
      out.push_back(F::from_functional_tensor(t));
    } else {
      out.push_back(t);
    }
  }
  return out;
}

void write_back(at::TensorList mutated, const TensorList& updated) {
  namespace F = torch_private::functionalization;
  for (size_t i = 0; i < mutated.size(); ++i) {
    if (F::isFunctionalTensor(mutated[i])) {
      F::replace_(mutated[i], updated[i]);
      F::commit_update(mutated[i]);
      F::sync(mutated[i]);
    }
  }
}

// The functional variants: the same work on clones of the mutable inputs,
// whose new values are returned.
TensorList clone_all(at::TensorList tensors) {
  TensorList out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    out.push_back(t.clone());
  }
  return out;
}

// A compiled call's body changes clones of its declared-mutable arguments,
// which the graph writes back only when the call returns: a body that raised
// after changing one lost the change, where an eager call (and plain code)
// keeps it (issue 36). So the clones are written back before the error
// propagates. (A failing write-back keeps the body's error.)
template <typename Run>
auto keeping_mutations_if_raised(
    at::TensorList mutated,
    const TensorList& updated,
    Run&& run) {
  try {
    return run();
  } catch (...) {
    try {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < mutated.size() && i < updated.size(); ++i) {
        if (mutated[i].defined() && updated[i].defined() &&
            !mutated[i].is_meta() && !mutated[i].is_same(updated[i])) {
          mutated[i].copy_(updated[i]);
        }
      }
    } catch (...) {
    }
    throw;
  }
}

} // namespace

std::tuple<TensorList, TensorList> call_functional_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  auto updated = clone_all(mutated);
  auto out = keeping_mutations_if_raised(mutated, updated, [&] {
    return call_mutating_kernel(leaf, plan, inputs, updated);
  });
  return {std::move(out), std::move(updated)};
}

std::tuple<TensorList, TensorList> call_functional_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  return {call_mutating_meta(leaf, plan, inputs, mutated), clone_all(mutated)};
}

std::tuple<TensorList, at::Tensor, TensorList> forward_functional_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  auto updated = clone_all(mutated);
  auto [out, state] = keeping_mutations_if_raised(mutated, updated, [&] {
    return forward_mutating_kernel(leaf, plan, inputs, updated, differentiable);
  });
  return {std::move(out), std::move(state), std::move(updated)};
}

std::tuple<TensorList, at::Tensor, TensorList> forward_functional_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  auto [out, state] =
      forward_mutating_meta(leaf, plan, inputs, mutated, differentiable);
  return {std::move(out), std::move(state), clone_all(mutated)};
}

TensorList call_mutating_functionalize(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::call_functional", "")
                       .typed<std::tuple<TensorList, TensorList>(
                           int64_t, int64_t, at::TensorList, at::TensorList)>();
  auto in = unwrap(inputs);
  auto mut = unwrap(mutated);
  std::tuple<TensorList, TensorList> out;
  {
    torch_private::ExcludeDispatchKeyGuard skip(
        c10::DispatchKey::Functionalize);
    out = op.call(leaf, plan, in, mut);
  }
  write_back(mutated, std::get<1>(out));
  return torch_private::functionalization::to_functional_tensor(
      std::get<0>(out));
}

std::tuple<TensorList, at::Tensor> forward_mutating_functionalize(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::forward_functional", "")
                       .typed<std::tuple<TensorList, at::Tensor, TensorList>(
                           int64_t,
                           int64_t,
                           at::TensorList,
                           at::TensorList,
                           at::IntArrayRef)>();
  auto in = unwrap(inputs);
  auto mut = unwrap(mutated);
  std::tuple<TensorList, at::Tensor, TensorList> out;
  {
    torch_private::ExcludeDispatchKeyGuard skip(
        c10::DispatchKey::Functionalize);
    out = op.call(leaf, plan, in, mut, differentiable);
  }
  write_back(mutated, std::get<2>(out));
  namespace F = torch_private::functionalization;
  return {
      F::to_functional_tensor(std::get<0>(out)),
      F::to_functional_tensor(std::get<1>(out))};
}

} // namespace torchleaf::ops
