// Public C++ API: defining leaf functions as named operators and calling them.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <cctype>

#include <torchleaf/errors.h>
#include <torchleaf/leaf.h>

#include "ops/leaf_ops.h"
#include "registry.h"

namespace torchleaf {
namespace {

bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) {
    return false;
  }
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) {
      return false;
    }
  }
  return true;
}

// Pops the named operator's arguments: (Tensor[] inputs[, Tensor[] mutated]).
std::pair<TensorList, TensorList> pop_inputs(
    const LeafEntry& entry,
    torch::jit::Stack* stack) {
  TensorList mutated;
  if (!entry.options.mutates_inputs.empty()) {
    mutated = torch::jit::pop(*stack).toTensorVector();
  }
  TensorList inputs = torch::jit::pop(*stack).toTensorVector();
  return {std::move(inputs), std::move(mutated)};
}

// Kernels of a named leaf operator: the same work as torchleaf::call's,
// bound to one entry.
struct NamedLeafKernel final : public c10::OperatorKernel {
  enum class Kind { Real, Fake, Autograd };
  NamedLeafKernel(const LeafEntry* entry, Kind kind) : entry_(entry), kind_(kind) {}

  void operator()(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet keys,
      torch::jit::Stack* stack) {
    if (kind_ == Kind::Autograd) {
      const size_t num_args = op.schema().arguments().size();
      auto args = torch::jit::last(*stack, num_args);
      TensorList inputs = args[0].toTensorVector();
      TensorList mutated = entry_->options.mutates_inputs.empty()
          ? TensorList()
          : args[1].toTensorVector();
      if (auto out = ops::call_autograd(*entry_, inputs, mutated)) {
        torch::jit::drop(*stack, num_args);
        torch::jit::push(*stack, std::move(*out));
        return;
      }
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
      return;
    }
    auto [inputs, mutated] = pop_inputs(*entry_, stack);
    torch::jit::push(
        *stack,
        kind_ == Kind::Real ? ops::call_real(*entry_, inputs, mutated)
                            : ops::call_fake(*entry_, inputs, mutated));
  }

 private:
  const LeafEntry* entry_;
  Kind kind_;
};

torch::CppFunction kernel(const LeafEntry* entry, NamedLeafKernel::Kind kind) {
  return torch::CppFunction::makeFromBoxedFunctor(
      std::make_unique<NamedLeafKernel>(entry, kind));
}

const c10::OperatorHandle& named_op(const LeafEntry& entry) {
  // Resolved once per call site is not possible for a runtime-defined op; the
  // dispatcher lookup is a hash of the name, cached here per entry.
  thread_local std::vector<std::optional<c10::OperatorHandle>> cache;
  if (cache.size() <= static_cast<size_t>(entry.id)) {
    cache.resize(entry.id + 1);
  }
  auto& slot = cache[entry.id];
  if (!slot) {
    slot = c10::Dispatcher::singleton().findSchemaOrThrow(entry.name.c_str(), "");
  }
  return *slot;
}

} // namespace

LeafFunction define_leaf(
    const std::string& qualified_name,
    LeafFn real,
    LeafFn fake,
    LeafOptions options) {
  const auto sep = qualified_name.find("::");
  const std::string ns =
      sep == std::string::npos ? "" : qualified_name.substr(0, sep);
  const std::string name =
      sep == std::string::npos ? "" : qualified_name.substr(sep + 2);
  TORCHLEAF_CHECK(
      is_identifier(ns) && is_identifier(name),
      qualified_name,
      "has a malformed name: expected \"namespace::name\" where both parts "
      "are identifiers (letters, digits, underscores), e.g. \"mylib::scale\".");
  TORCHLEAF_CHECK(
      static_cast<bool>(real),
      qualified_name,
      "needs a real implementation; pass a non-empty LeafFn.");
  for (auto p : options.mutates_inputs) {
    TORCHLEAF_CHECK(
        p >= 0,
        qualified_name,
        "declares a negative mutable input position ",
        p);
  }
  std::sort(options.mutates_inputs.begin(), options.mutates_inputs.end());

  auto owned = std::make_unique<LeafEntry>();
  owned->name = qualified_name;
  owned->real = std::move(real);
  owned->fake = std::move(fake);
  owned->options = std::move(options);
  owned->has_named_op = true;
  LeafEntry& entry = register_leaf(std::move(owned));

  const bool has_mutated = !entry.options.mutates_inputs.empty();
  auto lib = std::make_unique<torch::Library>(
      torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
  const std::string schema = name +
      (has_mutated ? "(Tensor[] inputs, Tensor(a!)[] mutated) -> Tensor[]"
                   : "(Tensor[] inputs) -> Tensor[]");
  lib->def(schema.c_str());
  using Kind = NamedLeafKernel::Kind;
  lib->impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, kernel(&entry, Kind::Autograd)));
  lib->impl(
      name.c_str(),
      torch::dispatch(
          c10::DispatchKey::CompositeExplicitAutograd, kernel(&entry, Kind::Real)));
  lib->impl(name.c_str(), torch::dispatch(c10::DispatchKey::Meta, kernel(&entry, Kind::Fake)));
  entry.library = std::move(lib);
  return LeafFunction(&entry);
}

std::optional<LeafFunction> find_leaf(const std::string& qualified_name) {
  if (const auto* entry = find_leaf_entry(qualified_name)) {
    return LeafFunction(entry);
  }
  return std::nullopt;
}

TensorList LeafFunction::operator()(const TensorList& inputs) const {
  const auto& op = named_op(*entry_);
  torch::jit::Stack stack;
  const auto& declared = entry_->options.mutates_inputs;
  if (declared.empty()) {
    stack.emplace_back(inputs);
  } else {
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
    stack.emplace_back(std::move(plain));
    stack.emplace_back(std::move(mutated));
  }
  op.callBoxed(stack);
  return stack.back().toTensorVector();
}

int64_t LeafFunction::id() const {
  return entry_->id;
}

const std::string& LeafFunction::name() const {
  return entry_->name;
}

} // namespace torchleaf
