// Misuse of the C++ API gets clear errors and leaves the process usable.
#include "test_util.h"

using torchleaf::TensorList;

namespace {
TensorList twice(const TensorList& in) {
  return {in[0] * 2};
}
TensorList twice_fake(const TensorList& in) {
  return {at::empty_like(in[0])};
}
} // namespace

TEST(Errors, DuplicateAndMalformedNames) {
  const auto name = unique_name("dup");
  torchleaf::define_leaf(name, twice, twice_fake);
  EXPECT_THROW_WITH(torchleaf::define_leaf(name, twice, twice_fake), "is already defined");
  EXPECT_THROW_WITH(torchleaf::define_leaf("no_namespace", twice, twice_fake), "malformed name");
  EXPECT_THROW_WITH(torchleaf::define_leaf("ns::has space", twice, twice_fake), "malformed name");
  EXPECT_THROW_WITH(torchleaf::define_leaf("1ns::x", twice, twice_fake), "malformed name");
  EXPECT_THROW_WITH(torchleaf::define_leaf(unique_name("noreal"), nullptr, twice_fake), "needs a real implementation");
}

TEST(Errors, ExceptionsInTheRealFunctionNameTheLeafAndLeaveNoState) {
  const auto name = unique_name("throws");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) -> TensorList {
        TORCH_CHECK(in[0].sum().item<float>() < 100, "too big");
        return {in[0] + 1};
      },
      twice_fake);
  auto x = torch::full({2}, 100.0, torch::requires_grad(true));
  try {
    leaf({x});
    ADD_FAILURE() << "expected an exception";
  } catch (const c10::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("too big"), std::string::npos);
    EXPECT_NE(what.find(name), std::string::npos) << what;
  }
  EXPECT_EQ(torchleaf::live_states(), 0);
  auto ok = leaf({torch::ones({2}, torch::requires_grad(true))});
  EXPECT_TRUE(torch::allclose(ok[0], torch::full({2}, 2.0)));
}

TEST(Errors, ErrorsAreLeafErrors) {
  auto leaf = torchleaf::define_leaf(
      unique_name("undef"), [](const TensorList&) { return TensorList{at::Tensor()}; }, twice_fake);
  EXPECT_THROW(leaf({torch::ones({1})}), torchleaf::LeafError);
  EXPECT_THROW_WITH(leaf({torch::ones({1})}), "returned an undefined tensor at output 0");
}

TEST(Errors, MutatingAnInputThatRequiresGrad) {
  auto leaf = torchleaf::define_leaf(
      unique_name("mut_grad"),
      [](const TensorList& in) {
        in[1].add_(1);
        return TensorList{in[0] * 2};
      },
      twice_fake, torchleaf::LeafOptions().mutates({1}));
  auto x = torch::ones({2}, torch::requires_grad(true));
  auto buf = torch::zeros({1}, torch::requires_grad(true));
  EXPECT_THROW_WITH(leaf({x, buf}), "in-place mutation of differentiable inputs is not supported");
}
