// Misuse of the C++ API gets clear errors and leaves the process usable.
#include "test_util.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/forward_grad.h>

#include "csrc/ops/leaf_ops.h"
#include "csrc/registry.h"

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
  EXPECT_THROW_WITH(
      torchleaf::define_leaf(name, twice, twice_fake), "is already defined");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf("no_namespace", twice, twice_fake),
      "malformed name");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf("ns::has space", twice, twice_fake),
      "malformed name");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf("1ns::x", twice, twice_fake), "malformed name");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf("aten::add", twice, twice_fake),
      "uses the namespace 'aten', which holds PyTorch's (or torchleaf's) own operators");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf("torchleaf::call", twice, twice_fake),
      "uses the namespace 'torchleaf'");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf(unique_name("noreal"), nullptr, twice_fake),
      "needs a real implementation");
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
      unique_name("undef"),
      [](const TensorList&) { return TensorList{at::Tensor()}; },
      twice_fake);
  EXPECT_THROW(leaf({torch::ones({1})}), torchleaf::LeafError);
  EXPECT_THROW_WITH(
      leaf({torch::ones({1})}), "returned an undefined tensor at output 0");
}

TEST(Errors, MutatingAnInputThatRequiresGrad) {
  auto leaf = torchleaf::define_leaf(
      unique_name("mut_grad"),
      [](const TensorList& in) {
        in[1].add_(1);
        return TensorList{in[0] * 2};
      },
      twice_fake,
      torchleaf::LeafOptions().mutates({1}));
  auto x = torch::ones({2}, torch::requires_grad(true));
  auto buf = torch::zeros({1}, torch::requires_grad(true));
  EXPECT_THROW_WITH(
      leaf({x, buf}),
      "in-place mutation of differentiable inputs is not supported");
}

// One tensor (or views of one) passed as an input the function reads and as
// one it mutates: refused before the function runs (it ran, and then was
// told its declared mutation was undeclared).
TEST(Errors, ATensorPassedAsReadAndAsMutableInputIsRefusedBeforeTheCall) {
  int real_calls = 0;
  auto leaf = torchleaf::define_leaf(
      unique_name("read_and_mutated"),
      [&](const TensorList& in) {
        ++real_calls;
        in[1].add_(1);
        return TensorList{in[0] * 2};
      },
      twice_fake,
      torchleaf::LeafOptions().mutates({1}));
  auto b = torch::zeros({3});
  const std::string msg =
      "as input 0, which it reads, and as input 1, which it mutates in place";
  EXPECT_THROW_WITH(leaf({b, b}), msg);
  EXPECT_THROW_WITH(leaf({b[0], b}), msg);
  EXPECT_EQ(real_calls, 0);
  EXPECT_EQ(b.sum().item<float>(), 0.0f);
  EXPECT_TRUE(torch::allclose(leaf({b.clone(), b})[0], torch::zeros({3})));
  EXPECT_EQ(b.sum().item<float>(), 3.0f);
}

// The fake's errors name the leaf, as the real function's do.
TEST(Errors, ExceptionsInTheFakeNameTheLeaf) {
  const auto name = unique_name("fake_throws");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{in[0] + 1}; },
      [](const TensorList&) -> TensorList { TORCH_CHECK(false, "fake boom"); });
  EXPECT_THROW_WITH(
      leaf({torch::empty({2}, torch::kMeta)}),
      "while running the fake implementation of leaf function '" + name + "'");
  EXPECT_TRUE(
      torch::allclose(leaf({torch::ones({2})})[0], torch::full({2}, 2.0)));
}

namespace {
using PlainSig = TensorList(at::TensorList);
using MutatingSig = TensorList(at::TensorList, at::TensorList);
using CallSig = TensorList(int64_t, int64_t, at::TensorList);
using ForwardSig = std::tuple<TensorList, at::Tensor>(
    int64_t,
    int64_t,
    at::TensorList,
    at::IntArrayRef);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const std::string& name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name.c_str(), "")
      .typed<Sig>();
}
} // namespace

TEST(Errors, DeclaredArityIsCheckedOnEveryPath) {
  const auto name = unique_name("arity");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{in[0] + in[1]}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().inputs(2));
  auto x = torch::ones({2});
  auto g = torch::ones({2}, torch::requires_grad(true));
  auto m = torch::ones({2}, torch::device(torch::kMeta));
  const std::string few =
      "takes 2 input tensor(s) (LeafOptions::inputs) but was called with 1";
  const std::string many =
      "takes 2 input tensor(s) (LeafOptions::inputs) but was called with 3";
  // LeafFunction::operator(): no gradient, gradient (the eager Autograd path).
  EXPECT_THROW_WITH(leaf({x}), few);
  EXPECT_THROW_WITH(leaf({g}), few);
  EXPECT_THROW_WITH(leaf({x, x, x}), many);
  EXPECT_THROW_WITH(leaf({}), "but was called with 0");
  // The named operator: real, autograd, meta (the fake) kernels.
  auto named = op<PlainSig>(name);
  EXPECT_THROW_WITH(named.call({x}), few);
  EXPECT_THROW_WITH(named.call({g}), few);
  EXPECT_THROW_WITH(named.call({m}), few);
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    EXPECT_THROW_WITH(named.call({x}), few);
  }
  // The generic operators, as graphs call them.
  EXPECT_THROW_WITH(
      op<CallSig>("torchleaf::call").call(leaf.id(), 0, {x}), few);
  EXPECT_THROW_WITH(
      op<CallSig>("torchleaf::call").call(leaf.id(), 0, {m}), few);
  EXPECT_THROW_WITH(
      op<ForwardSig>("torchleaf::forward").call(leaf.id(), 0, {g}, {0}), few);
  EXPECT_THROW(leaf({x}), torchleaf::LeafError);
  EXPECT_EQ(torchleaf::live_states(), 0);
  // The process is fine and correct calls work everywhere.
  EXPECT_TRUE(torch::allclose(leaf({x, g})[0], torch::full({2}, 2.0)));
  EXPECT_TRUE(torch::allclose(named.call({x, x})[0], torch::full({2}, 2.0)));
  EXPECT_EQ(named.call({m, m})[0].device().type(), c10::DeviceType::Meta);
}

TEST(Errors, DeclaredArityCountsMutableInputs) {
  const auto name = unique_name("arity_mut");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) {
        in[1].add_(1);
        return TensorList{in[0] + in[2]};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().inputs(3).mutates({1}));
  auto x = torch::ones({2});
  auto buf = torch::zeros({1});
  EXPECT_THROW_WITH(
      leaf({x, buf}),
      "takes 3 input tensor(s) (LeafOptions::inputs) but was called with 2");
  auto named = op<MutatingSig>(name);
  EXPECT_THROW_WITH(named.call({x}, {buf}), "but was called with 2");
  EXPECT_THROW_WITH(named.call({x, x, x}, {buf}), "but was called with 4");
  EXPECT_EQ(buf.item<float>(), 0.0f);
  EXPECT_TRUE(torch::allclose(leaf({x, buf, x})[0], torch::full({2}, 2.0)));
  EXPECT_EQ(buf.item<float>(), 1.0f);
  // A mutable input that requires grad is named by its input position.
  auto wants_grad = torch::zeros({1}, torch::requires_grad());
  EXPECT_THROW_WITH(
      leaf({x, wants_grad, x}),
      "declares input 1 mutable but it requires grad");
  EXPECT_EQ(buf.item<float>(), 1.0f);
}

TEST(Errors, MalformedArityOrMutablePositionsAtDefinition) {
  auto add = [](const TensorList& in) { return TensorList{in[0] + in[1]}; };
  EXPECT_THROW_WITH(
      torchleaf::define_leaf(
          unique_name("neg_arity"),
          add,
          twice_fake,
          torchleaf::LeafOptions().inputs(-1)),
      "declares a negative number of inputs");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf(
          unique_name("mut_beyond"),
          add,
          twice_fake,
          torchleaf::LeafOptions().inputs(2).mutates({2})),
      "declares mutable input position 2 but takes only 2 input(s)");
  EXPECT_THROW_WITH(
      torchleaf::define_leaf(
          unique_name("mut_twice"),
          add,
          twice_fake,
          torchleaf::LeafOptions().mutates({1, 1})),
      "declares mutable input position 1 more than once");
}

TEST(Errors, WithoutADeclaredArityTooFewInputsNeverCrashTheMerge) {
  // The user's function is not reached when the declared mutable position
  // lies beyond the call's inputs.
  const auto name = unique_name("mut_far");
  bool ran = false;
  auto leaf = torchleaf::define_leaf(
      name,
      [&ran](const TensorList& in) {
        ran = true;
        return TensorList{in[0] * 2};
      },
      twice_fake,
      torchleaf::LeafOptions().mutates({3}));
  auto x = torch::ones({2});
  auto buf = torch::zeros({1});
  auto m = torch::ones({2}, torch::device(torch::kMeta));
  auto named = op<MutatingSig>(name);
  const std::string msg =
      "declares mutable input position 3 but was called with 2 input tensor(s)";
  EXPECT_THROW_WITH(named.call({x}, {buf}), msg);
  EXPECT_THROW_WITH(named.call({m}, {m}), msg);
  EXPECT_THROW_WITH(named.call({x.requires_grad_(true)}, {buf}), msg);
  EXPECT_THROW_WITH(
      named.call({}, {buf}),
      "declares mutable input position 3 but was called with 1");
  EXPECT_THROW_WITH(
      leaf({x}), "declares mutable input positions beyond the 1 inputs");
  EXPECT_FALSE(ran);
  EXPECT_TRUE(
      torch::allclose(named.call({x, x, x}, {buf})[0], torch::full({2}, 2.0)));
  EXPECT_TRUE(ran);
}

TEST(Errors, ForwardModeTangentsAreRefusedNotDropped) {
  // The captured graph only runs backward: a dual input's tangent would be
  // lost without a word, so the call is refused on every path.
  const auto name = unique_name("fwad");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{(in[0] * 3).sin()}; },
      twice_fake);
  auto x = torch::randn({3});
  auto v = torch::randn({3});
  const std::string msg =
      "received a forward-mode AD tangent at input 0, but forward-mode AD (jvp, make_dual) is "
      "not supported through leaf function '" +
      name + "'";
  // What `with torch.autograd.forward_ad.dual_level()` does.
  struct DualLevel {
    uint64_t idx = torch::autograd::ForwardADLevel::get_next_idx();
    ~DualLevel() {
      torch::autograd::ForwardADLevel::release_idx(idx);
    }
  };
  {
    DualLevel dual_level;
    const auto level = dual_level.idx;
    auto dual = at::_make_dual(x, v, static_cast<int64_t>(level));
    EXPECT_THROW_WITH(leaf({dual}), msg);
    EXPECT_THROW_WITH(
        leaf({dual.narrow(0, 1, 2)}), msg); // a view of a dual tensor
    EXPECT_THROW_WITH(op<PlainSig>(name).call({dual}), msg);
    EXPECT_THROW_WITH(
        op<CallSig>("torchleaf::call").call(leaf.id(), 0, {dual}), msg);
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      EXPECT_THROW_WITH(op<PlainSig>(name).call({dual}), msg);
    }
    auto dual_grad = at::_make_dual(
        x.clone().requires_grad_(true), v, static_cast<int64_t>(level));
    EXPECT_THROW_WITH(leaf({dual_grad}), msg);
    EXPECT_THROW(leaf({dual}), torchleaf::LeafError);
    // Without a tangent, a call inside a forward-AD level is ordinary.
    EXPECT_TRUE(torch::allclose(leaf({x})[0], (x * 3).sin()));
  }
  EXPECT_EQ(torchleaf::live_states(), 0);
  EXPECT_TRUE(torch::allclose(leaf({x})[0], (x * 3).sin()));
}

// A named operator's real outputs are checked against what its fake gave when
// a graph was traced (here: the fake kernel run on the same inputs, as
// torch.compile runs it on fake tensors of them), with validation off.
TEST(Errors, RealOutputsAreCheckedAgainstTheTracedFake) {
  const auto name = unique_name("wrong_fake");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{in[0].sum(0)}; },
      twice_fake);
  auto x = torch::ones({2, 3});
  EXPECT_EQ(leaf({x})[0].sizes(), at::IntArrayRef({3})); // nothing traced: runs
  auto entry = torchleaf::find_leaf_entry(name);
  torchleaf::CallSite site;
  torchleaf::ops::call_fake(*entry, {x}, {}, site);
  EXPECT_THROW_WITH(
      leaf({x}),
      "output 0 has 1-d shape [3] but the fake implementation returned 2-d shape [2, 3] when the "
      "graph was traced");
  EXPECT_THROW(
      leaf({x.requires_grad_()}),
      torchleaf::LeafError); // the eager autograd path too
  // Inputs no trace saw are not checked; the error left nothing behind.
  EXPECT_EQ(leaf({torch::ones({4, 3})})[0].sizes(), at::IntArrayRef({3}));
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Errors, OutputStridesAreCheckedOnlyWhereATraceReliesOnThem) {
  const auto name = unique_name("wrong_strides");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{(in[0] * 2).t()}; },
      [](const TensorList& in) {
        return TensorList{
            at::empty({in[0].size(1), in[0].size(0)}, in[0].options())};
      });
  auto x = torch::ones({2, 3});
  auto entry = torchleaf::find_leaf_entry(name);
  torchleaf::CallSite site;
  torchleaf::ops::call_fake(
      *entry, {x}, {}, site); // aot_eager-like: no opinion on strides
  EXPECT_EQ(leaf({x})[0].strides(), at::IntArrayRef({1, 3}));
  torchleaf::ops::call_fake(
      *entry, {x}, {}, site, /*strides_relied_on=*/true); // Inductor-like
  EXPECT_THROW_WITH(
      leaf({x}),
      "output 0 has strides [1, 3] (shape [3, 2]) but the fake implementation returned strides [2, 1]");
  // A column-major input is another input layout: no trace saw its strides.
  auto y = torch::ones({2, 3}).t().contiguous().t();
  EXPECT_EQ(leaf({y})[0].sizes(), at::IntArrayRef({3, 2}));
}
