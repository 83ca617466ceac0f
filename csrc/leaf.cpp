// Public C++ API: defining leaf functions as named operators and calling them.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>

#include <torchleaf/errors.h>
#include <torchleaf/leaf.h>

#include "ops/kernel_wiring.h"
#include "ops/leaf_ops.h"
#include "registry.h"

namespace torchleaf {
namespace {

using LeafSignature = TensorList(at::TensorList);
using MutatingLeafSignature = TensorList(at::TensorList, at::TensorList);

// The typed handle of a named leaf operator (typed() only re-checks the
// signature in debug builds).
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const LeafEntry& entry) {
  return entry.named_op->typed<Signature>();
}

// Registers the kernels of a named leaf operator: the same work as
// torchleaf::call's, bound to one entry. Unboxed, so that a call from C++
// costs no boxing.
void register_kernels(
    torch::Library& lib,
    const std::string& name,
    const LeafEntry* entry) {
  if (entry->options.mutates_inputs.empty()) {
    ops::register_leaf_kernels(
        lib,
        name.c_str(),
        [entry](at::TensorList in) {
          CallSite site;
          return ops::call_real(*entry, in, {}, site);
        },
        [entry](at::TensorList in) {
          CallSite site;
          return ops::call_fake(*entry, in, {}, site);
        },
        [entry](c10::DispatchKeySet keys, at::TensorList in) {
          CallSite site;
          if (auto out = ops::call_autograd(*entry, in, {}, site)) {
            return std::move(*out);
          }
          return ops::redispatch_below_autograd(
              typed_op<LeafSignature>(*entry), keys, in);
        });
    return;
  }
  ops::register_leaf_kernels(
      lib,
      name.c_str(),
      [entry](at::TensorList in, at::TensorList mutated) {
        CallSite site;
        return ops::call_real(*entry, in, mutated, site);
      },
      [entry](at::TensorList in, at::TensorList mutated) {
        CallSite site;
        return ops::call_fake(*entry, in, mutated, site);
      },
      [entry](
          c10::DispatchKeySet keys, at::TensorList in, at::TensorList mutated) {
        CallSite site;
        if (auto out = ops::call_autograd(*entry, in, mutated, site)) {
          return std::move(*out);
        }
        return ops::redispatch_below_autograd(
            typed_op<MutatingLeafSignature>(*entry), keys, in, mutated);
      },
      // The same as torchleaf::call_mutating's.
      [entry](at::TensorList in, at::TensorList mutated) {
        return ops::call_mutating_functionalize(
            entry->id, /*plan=*/0, in, mutated);
      });
}

} // namespace
LeafFunction define_leaf(
    const std::string& qualified_name,
    LeafFn real,
    LeafFn fake,
    LeafOptions options) {
  const auto [ns, name] = split_qualified_name(qualified_name);
  TORCHLEAF_CHECK(
      static_cast<bool>(real),
      qualified_name,
      "needs a real implementation; pass a non-empty LeafFn.");
  if (options.num_inputs.has_value()) {
    TORCHLEAF_CHECK(
        *options.num_inputs >= 0,
        qualified_name,
        "declares a negative number of inputs (LeafOptions::inputs(",
        *options.num_inputs,
        ")).");
  }
  for (auto p : options.mutates_inputs) {
    TORCHLEAF_CHECK(
        p >= 0,
        qualified_name,
        "declares a negative mutable input position ",
        p);
    TORCHLEAF_CHECK(
        !options.num_inputs.has_value() || p < *options.num_inputs,
        qualified_name,
        "declares mutable input position ",
        p,
        " but takes only ",
        options.num_inputs.value_or(0),
        " input(s) (LeafOptions::inputs).");
  }
  std::sort(options.mutates_inputs.begin(), options.mutates_inputs.end());
  // The merge of a call's inputs and mutated tensors relies on distinct
  // positions (a repeated one would make the leaf uncallable).
  const auto repeated = std::adjacent_find(
      options.mutates_inputs.begin(), options.mutates_inputs.end());
  TORCHLEAF_CHECK(
      repeated == options.mutates_inputs.end(),
      qualified_name,
      "declares mutable input position ",
      repeated == options.mutates_inputs.end() ? 0 : *repeated,
      " more than once (LeafOptions::mutates).");

  // Nothing is published until the operator is defined: a failed
  // definition leaves no trace, and defining the name again may succeed.
  check_name_free(qualified_name);
  auto entry = std::make_shared<LeafEntry>();
  entry->name = qualified_name;
  entry->real = [fn = std::move(real)](const TensorList& in, CallSite&) {
    return fn(in);
  };
  if (fake) {
    entry->fake = [fn = std::move(fake)](const TensorList& in, CallSite&) {
      return fn(in);
    };
  }
  entry->options = std::move(options);
  entry->id = named_leaf_id(qualified_name);

  const bool has_mutated = !entry->options.mutates_inputs.empty();
  auto lib = std::make_unique<torch::Library>(
      torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
  const std::string schema = name +
      (has_mutated ? "(Tensor[] inputs, Tensor(a!)[] mutated) -> Tensor[]"
                   : "(Tensor[] inputs) -> Tensor[]");
  const auto tags =
      ops::leaf_operator_tags(); // (a named list: see leaf_ops.cpp)
  lib->def(schema.c_str(), tags);
  register_kernels(*lib, name, entry.get());
  entry->named_op = c10::Dispatcher::singleton().findSchemaOrThrow(
      qualified_name.c_str(), "");
  entry->library = std::move(lib);
  const LeafEntry* published = entry.get(); // immortal once registered
  register_leaf(std::move(entry));
  return LeafFunction(published);
}

std::optional<LeafFunction> find_leaf(const std::string& qualified_name) {
  if (auto entry = find_leaf_entry(qualified_name)) {
    return LeafFunction(entry.get()); // named entries are immortal
  }
  return std::nullopt;
}

TensorList LeafFunction::operator()(const TensorList& inputs) const {
  // Before the split below, so that a wrong count reads as one.
  entry_->check_input_count(inputs.size());
  const auto& declared = entry_->options.mutates_inputs;
  if (declared.empty()) {
    return typed_op<LeafSignature>(*entry_).call(inputs);
  }
  TensorList plain;
  TensorList mutated;
  for (size_t i = 0; i < inputs.size(); ++i) {
    (entry_->mutates(i) ? mutated : plain).push_back(inputs[i]);
  }
  TORCHLEAF_CHECK(
      mutated.size() == declared.size(),
      entry_->name,
      "declares mutable input positions beyond the ",
      inputs.size(),
      " inputs it was called with.");
  return typed_op<MutatingLeafSignature>(*entry_).call(plain, mutated);
}

int64_t LeafFunction::id() const {
  return entry_->id;
}

const std::string& LeafFunction::name() const {
  return entry_->name;
}

} // namespace torchleaf
