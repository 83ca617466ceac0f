#pragma once

// Which dispatch key runs which kernel of an operator that runs a leaf: the
// one place that says so, for the three kinds of such operators --
// torchleaf's own (schema.cpp), a C++ leaf's named operator (leaf.cpp) and a
// named operator bound to a host-language leaf (bound_named_ops.cpp).
//
//   real           CompositeExplicitAutograd: one kernel for every backend
//                  (CPU, CUDA, ...), which runs the leaf's real function
//   fake           Meta: meta tensors, and FakeTensor through them
//   autograd       Autograd: captures the call for backward, or goes below
//                  Autograd (redispatch_below_autograd); operators that are
//                  only ever called below Autograd have none
//   functionalize  Functionalize: mutating operators only, which call their
//                  functional variant
//
// A kernel is anything torch::CppFunction takes: a function pointer, a
// lambda (unboxed; a DispatchKeySet first argument receives the keys), or a
// CppFunction (boxed kernels). NoKernel leaves a key without one.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <type_traits>
#include <utility>

namespace torchleaf::ops {

struct NoKernel {};

template <
    class Real,
    class Fake,
    class Autograd,
    class Functionalize = NoKernel>
void register_leaf_kernels(
    torch::Library& lib,
    const char* name,
    Real&& real,
    Fake&& fake,
    Autograd&& autograd,
    Functionalize&& functionalize = NoKernel{}) {
  auto impl = [&](c10::DispatchKey key, auto&& kernel) {
    if constexpr (!std::is_same_v<std::decay_t<decltype(kernel)>, NoKernel>) {
      lib.impl(
          name, torch::dispatch(key, std::forward<decltype(kernel)>(kernel)));
    }
  };
  impl(c10::DispatchKey::CompositeExplicitAutograd, std::forward<Real>(real));
  impl(c10::DispatchKey::Meta, std::forward<Fake>(fake));
  impl(c10::DispatchKey::Autograd, std::forward<Autograd>(autograd));
  impl(
      c10::DispatchKey::Functionalize,
      std::forward<Functionalize>(functionalize));
}

// What an Autograd kernel does when the call needs no graph: the same
// operator below Autograd (its real or fake kernel).
template <class Signature, class... Args>
auto redispatch_below_autograd(
    const c10::TypedOperatorHandle<Signature>& op,
    c10::DispatchKeySet keys,
    Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.redispatch(
      keys & c10::after_ADInplaceOrView_keyset, std::forward<Args>(args)...);
}

} // namespace torchleaf::ops
