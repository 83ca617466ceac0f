// Named operators bound at run time to host-language leaves; see
// bound_named_ops.h.

#include "bound_named_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <unordered_map>

#include <torchleaf/errors.h>

#include "../registry.h"
#include "kernel_wiring.h"
#include "leaf_ops.h"

namespace torchleaf::ops {
namespace {

// One per operator name, for the life of the process. Holds the leaf it is
// bound to weakly: the operator must not keep a dead leaf's function alive.
struct BoundOperator {
  std::string name;
  bool mutating = false;
  std::unique_ptr<torch::Library> library;
  c10::OperatorHandle handle;

  std::mutex mutex; // guards everything below
  std::weak_ptr<const LeafEntry> entry;
  PlanResolver resolver;
  // Call description -> plan of the current leaf (cleared on rebinding).
  std::unordered_map<std::string, int64_t> plans;

  BoundOperator(std::string n, bool m, std::unique_ptr<torch::Library> lib)
      : name(std::move(n)),
        mutating(m),
        library(std::move(lib)),
        handle(
            c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")) {}

  // The bound leaf and the plan for `call`.
  std::pair<LeafEntryPtr, int64_t> resolve(const std::string& call) {
    LeafEntryPtr leaf;
    PlanResolver resolve_plan;
    {
      std::lock_guard<std::mutex> lock(mutex);
      leaf = entry.lock();
      TORCHLEAF_CHECK(
          leaf != nullptr,
          name,
          "is not bound to a live leaf function in this process. Import the "
          "module that defines it (@torchleaf.leaf_function(name=\"",
          name,
          "\")) before running a program that calls it; the call names that "
          "module in its \"import\" field: ",
          call);
      auto it = plans.find(call);
      if (it != plans.end()) {
        return {std::move(leaf), it->second};
      }
      resolve_plan = resolver;
    }
    // Outside the lock: the resolver runs host-language code (which may call
    // this operator again, e.g. to trace a fake).
    const int64_t plan = resolve_plan(leaf->id, call);
    std::lock_guard<std::mutex> lock(mutex);
    if (entry.lock() == leaf) {
      plans.emplace(call, plan);
    }
    return {std::move(leaf), plan};
  }
};

using BoundOperatorPtr = std::shared_ptr<BoundOperator>;

std::mutex& operators_mutex() {
  static auto* m = new std::mutex();
  return *m;
}

// Leaked on purpose, like the registry: kernels may run during static
// destruction of other libraries.
std::unordered_map<std::string, BoundOperatorPtr>& operators() {
  static auto* table = new std::unordered_map<std::string, BoundOperatorPtr>();
  return *table;
}

using Signature = TensorList(at::TensorList, c10::string_view);
using MutatingSignature =
    TensorList(at::TensorList, at::TensorList, c10::string_view);

void register_kernels(
    torch::Library& lib,
    const std::string& name,
    const BoundOperatorPtr& op) {
  // One body per kernel, for both schemas: `mutated` is empty for the
  // non-mutating one.
  auto real =
      [op](at::TensorList in, at::TensorList mutated, c10::string_view call) {
        auto [leaf, plan] = op->resolve(std::string(call));
        CallSite site{plan};
        return call_real(*leaf, in, mutated, site);
      };
  auto fake =
      [op](at::TensorList in, at::TensorList mutated, c10::string_view call) {
        auto [leaf, plan] = op->resolve(std::string(call));
        CallSite site{plan};
        return call_fake(*leaf, in, mutated, site);
      };
  auto autograd = [op](
                      at::TensorList in,
                      at::TensorList mutated,
                      c10::string_view call) -> std::optional<TensorList> {
    auto [leaf, plan] = op->resolve(std::string(call));
    CallSite site{plan};
    return call_autograd(*leaf, in, mutated, site);
  };
  if (!op->mutating) {
    register_leaf_kernels(
        lib,
        name.c_str(),
        [real](at::TensorList in, c10::string_view call) {
          return real(in, {}, call);
        },
        [fake](at::TensorList in, c10::string_view call) {
          return fake(in, {}, call);
        },
        [autograd, op](
            c10::DispatchKeySet keys,
            at::TensorList in,
            c10::string_view call) {
          if (auto out = autograd(in, {}, call)) {
            return std::move(*out);
          }
          return redispatch_below_autograd(
              op->handle.typed<Signature>(), keys, in, call);
        });
    return;
  }
  register_leaf_kernels(
      lib,
      name.c_str(),
      real,
      fake,
      [autograd, op](
          c10::DispatchKeySet keys,
          at::TensorList in,
          at::TensorList mutated,
          c10::string_view call) {
        if (auto out = autograd(in, mutated, call)) {
          return std::move(*out);
        }
        return redispatch_below_autograd(
            op->handle.typed<MutatingSignature>(), keys, in, mutated, call);
      },
      [op](at::TensorList in, at::TensorList mutated, c10::string_view call) {
        auto [leaf, plan] = op->resolve(std::string(call));
        return call_mutating_functionalize(leaf->id, plan, in, mutated);
      });
}

BoundOperatorPtr define_operator(
    const std::string& qualified_name,
    bool mutating) {
  const auto [ns, name] = split_qualified_name(qualified_name);
  auto lib = std::make_unique<torch::Library>(
      torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
  const auto tags = leaf_operator_tags(); // (a named list: see leaf_ops.cpp)
  lib->def(
      (name +
       (mutating
            ? "(Tensor[] inputs, Tensor(a!)[] mutated, str call) -> Tensor[]"
            : "(Tensor[] inputs, str call) -> Tensor[]"))
          .c_str(),
      tags);
  auto op =
      std::make_shared<BoundOperator>(qualified_name, mutating, std::move(lib));
  register_kernels(*op->library, name, op);
  return op;
}

} // namespace

void bind_named_operator(
    const std::string& qualified_name,
    int64_t leaf,
    bool mutating,
    PlanResolver resolver) {
  TORCH_INTERNAL_ASSERT(static_cast<bool>(resolver));
  auto entry = get_leaf(leaf);
  TORCHLEAF_CHECK(
      find_leaf_entry(qualified_name) == nullptr,
      qualified_name,
      "is already a C++ leaf function's name; pick another name.");
  std::lock_guard<std::mutex> table_lock(operators_mutex());
  auto& table = operators();
  auto it = table.find(qualified_name);
  if (it == table.end()) {
    it =
        table.emplace(qualified_name, define_operator(qualified_name, mutating))
            .first;
  }
  BoundOperator& op = *it->second;
  TORCHLEAF_CHECK(
      op.mutating == mutating,
      qualified_name,
      "was defined earlier in this process ",
      op.mutating ? "with" : "without",
      " mutates_args, and an operator's schema cannot change; keep the "
      "declaration or pick another name.");
  std::lock_guard<std::mutex> lock(op.mutex);
  auto current = op.entry.lock();
  TORCHLEAF_CHECK(
      current == nullptr || current == entry,
      qualified_name,
      "is already the name of a live leaf function. Each named leaf function needs a unique \"namespace::name\"; pick "
      "another name, or delete the other leaf first.");
  op.entry = entry;
  op.resolver = std::move(resolver);
  op.plans.clear();
}

} // namespace torchleaf::ops
