// Calling the torchleaf operators from C++: through the dispatcher, or, for
// plain calls, straight to what their kernels would do.

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "../profiler_range.h"
#include "../state.h"
#include "kernels.h"
#include "leaf_ops.h"

namespace torchleaf::ops {

TensorList call(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  if (mutated.empty()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchleaf::call", "")
                         .typed<TensorList(int64_t, int64_t, at::TensorList)>();
    return op.call(leaf, plan, inputs);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::call_mutating", "")
                       .typed<TensorList(
                           int64_t, int64_t, at::TensorList, at::TensorList)>();
  return op.call(leaf, plan, inputs, mutated);
}

std::tuple<TensorList, at::Tensor> forward(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  using Result = std::tuple<TensorList, at::Tensor>;
  if (mutated.empty()) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torchleaf::forward", "")
            .typed<Result(int64_t, int64_t, at::TensorList, at::IntArrayRef)>();
    return op.call(leaf, plan, inputs, differentiable);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::forward_mutating", "")
                       .typed<Result(
                           int64_t,
                           int64_t,
                           at::TensorList,
                           at::TensorList,
                           at::IntArrayRef)>();
  return op.call(leaf, plan, inputs, mutated, differentiable);
}

TensorList backward(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::backward", "")
                       .typed<TensorList(
                           int64_t,
                           const at::Tensor&,
                           const c10::List<std::optional<at::Tensor>>&,
                           c10::SymIntArrayRef)>();
  return op.call(leaf, state, grads, input_meta);
}

namespace {

// Tensors whose dispatcher round trip does more than reach the kernels: the
// conjugate, negative and zero-tensor fallbacks materialize such inputs.
bool has_fallback_keys(at::TensorList tensors) {
  constexpr auto keys = c10::DispatchKeySet(
      {c10::DispatchKey::Conjugate,
       c10::DispatchKey::Negative,
       c10::DispatchKey::ZeroTensor});
  for (const auto& t : tensors) {
    if (t.key_set().has_any(keys)) {
      return true;
    }
  }
  return false;
}

} // namespace

std::optional<TensorList> call_plain(
    const LeafEntry& entry,
    int64_t plan,
    at::TensorList inputs) {
  if (!is_plain_eager(inputs, {}) || has_fallback_keys(inputs)) {
    return std::nullopt;
  }
  CallSite site{plan};
  return call_eager(entry, inputs, {}, site);
}

std::optional<std::tuple<TensorList, at::Tensor>> forward_plain(
    LeafEntryPtr entry,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable) {
  // With grad mode on, an input that requires grad makes the Autograd kernel
  // refuse a second derivative: that takes the operator.
  if (at::GradMode::is_enabled() || !is_plain_eager(inputs, {}) ||
      has_fallback_keys(inputs)) {
    return std::nullopt;
  }
  const ProfilerRange range("torchleaf::forward");
  check_no_forward_tangents(entry->id, inputs, {});
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return run_forward(std::move(entry), plan, inputs, {}, differentiable);
}

std::optional<TensorList> backward_plain(
    int64_t leaf,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads) {
  // Tensors are looked at in place, never copied: each is a Python tensor's,
  // whose copy and release cost a Python reference count with the GIL
  // released.
  if (at::GradMode::is_enabled() || !is_concrete_handle(state) ||
      !is_plain_eager(at::TensorList(state), {})) {
    return std::nullopt;
  }
  bool tangent = false;
  for (const auto& g : grads) {
    if (g.has_value() && g->defined()) {
      const at::TensorList one(*g);
      if (!is_plain_eager(one, {}) || has_fallback_keys(one)) {
        return std::nullopt;
      }
      tangent = tangent || has_forward_tangent(*g);
    }
  }
  const ProfilerRange range("torchleaf::backward");
  const auto captured = lookup_state(state, leaf);
  if (tangent) { // the error the Autograd kernel raises
    TensorList defined;
    for (const auto& g : grads) {
      if (g.has_value() && g->defined()) {
        defined.push_back(*g);
      }
    }
    check_no_forward_tangents(captured->entry->name, defined, {});
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return run_backward(*captured, state, grads);
}

} // namespace torchleaf::ops
