// Named operators bound at run time to host-language leaves
// (csrc/ops/bound_named_ops.h; Python: test_export.py): the operator takes a
// call description, resolves it to a plan once, holds its leaf weakly and
// rebinds when the name is defined again.
#include "test_util.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "csrc/ops/bound_named_ops.h"
#include "csrc/registry.h"

using torchleaf::TensorList;

namespace {

using BoundSig = TensorList(at::TensorList, c10::string_view);

// An unnamed leaf entry, as a host language registers one: multiplies by
// `factor` and reports the plan it was called with.
int64_t register_scaling_leaf(double factor, std::vector<int64_t>* plans) {
  auto entry = std::make_shared<torchleaf::LeafEntry>();
  entry->name = "bound_test_leaf";
  entry->real = [factor, plans](
                    const TensorList& in, torchleaf::CallSite& site) {
    plans->push_back(site.plan);
    return TensorList{in[0] * factor};
  };
  entry->fake = [](const TensorList& in, torchleaf::CallSite&) {
    return TensorList{at::empty_like(in[0])};
  };
  return torchleaf::register_leaf(std::move(entry));
}

} // namespace

TEST(BoundOperators, ResolveOncePerDescriptionHoldWeaklyAndRebind) {
  const std::string name = unique_name("bound");
  std::vector<int64_t> plans;
  int resolutions = 0;
  auto resolver = [&resolutions](int64_t, const std::string& call) {
    ++resolutions;
    return static_cast<int64_t>(call.size()); // any deterministic plan
  };
  const int64_t first = register_scaling_leaf(2.0, &plans);
  torchleaf::ops::bind_named_operator(
      name, first, /*mutating=*/false, resolver);
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow(name.c_str(), "")
                .typed<BoundSig>();

  auto x = torch::arange(3, torch::kFloat);
  auto y = op.call({x}, "abc");
  EXPECT_TRUE(torch::equal(y[0], x * 2));
  op.call({x}, "abc");
  op.call({x}, "abcdef");
  EXPECT_EQ(resolutions, 2); // once per distinct description
  EXPECT_EQ(plans, (std::vector<int64_t>{3, 3, 6}));

  // Gradients flow as through any leaf operator.
  auto xg = x.clone().requires_grad_(true);
  auto g = torch::autograd::grad({op.call({xg}, "abc")[0].sum()}, {xg})[0];
  EXPECT_TRUE(torch::equal(g, torch::full({3}, 2.0)));

  // A second live leaf cannot take the name.
  std::vector<int64_t> other_plans;
  const int64_t second = register_scaling_leaf(5.0, &other_plans);
  EXPECT_THROW_WITH(
      torchleaf::ops::bind_named_operator(name, second, false, resolver),
      "is already the name of a live leaf function");
  // Nor can the schema change.
  EXPECT_THROW_WITH(
      torchleaf::ops::bind_named_operator(name, first, true, resolver),
      "cannot change");

  // The operator does not keep its leaf: once it is gone, a clear error ...
  torchleaf::unregister_leaf(first);
  EXPECT_THROW_WITH(
      op.call({x}, "abc"), "is not bound to a live leaf function");
  // ... until another leaf takes the name, with plans resolved afresh.
  torchleaf::ops::bind_named_operator(name, second, false, resolver);
  EXPECT_TRUE(torch::equal(op.call({x}, "abc")[0], x * 5));
  EXPECT_EQ(resolutions, 3);
  torchleaf::unregister_leaf(second);
}

TEST(BoundOperators, MalformedAndCppNamesAreRefused) {
  std::vector<int64_t> plans;
  const int64_t leaf = register_scaling_leaf(1.0, &plans);
  auto resolver = [](int64_t, const std::string&) { return int64_t{0}; };
  EXPECT_THROW_WITH(
      torchleaf::ops::bind_named_operator(
          "no_namespace", leaf, false, resolver),
      "has a malformed name");
  auto cpp = torchleaf::define_leaf(
      unique_name("cpp_owned"),
      [](const TensorList& in) { return TensorList{in[0] * 1}; });
  EXPECT_THROW_WITH(
      torchleaf::ops::bind_named_operator(cpp.name(), leaf, false, resolver),
      "is already a C++ leaf function's name");
  torchleaf::unregister_leaf(leaf);
}
