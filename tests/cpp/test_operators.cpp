// The torchleaf operators are reachable from any C++ caller with arbitrary
// arguments: malformed ones get clear errors, never a crash or an
// out-of-bounds read (this suite also runs under `make sanitize`).
#include "test_util.h"

#include <ATen/core/dispatch/Dispatcher.h>

using torchleaf::TensorList;

namespace {

using ForwardSig = std::tuple<TensorList, at::Tensor>(
    int64_t,
    int64_t,
    at::TensorList,
    at::IntArrayRef);
using BackwardSig = TensorList(
    int64_t,
    const at::Tensor&,
    const c10::List<std::optional<at::Tensor>>&,
    c10::SymIntArrayRef);

c10::TypedOperatorHandle<ForwardSig> forward_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("torchleaf::forward", "")
      .typed<ForwardSig>();
}

c10::TypedOperatorHandle<BackwardSig> backward_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("torchleaf::backward", "")
      .typed<BackwardSig>();
}

torchleaf::LeafFunction square_leaf() {
  return torchleaf::define_leaf(
      unique_name("square"),
      [](const TensorList& in) { return TensorList{in[0] * in[0]}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
}

std::vector<c10::SymInt> meta(std::initializer_list<int64_t> values) {
  return std::vector<c10::SymInt>(values.begin(), values.end());
}

} // namespace

TEST(Operators, UnknownLeafIds) {
  auto x = torch::ones({2});
  EXPECT_THROW_WITH(
      forward_op().call(12345, 0, {x}, {0}), "no leaf function has id 12345");
  // Ids with the named bit set name C++ leaves.
  EXPECT_THROW_WITH(
      forward_op().call(int64_t{1} << 62 | 7, 0, {x}, {0}),
      "no C++ leaf function has id");
}

TEST(Operators, MalformedInputMetaIsAnErrorInTheMetaKernel) {
  auto leaf = square_leaf();
  auto state =
      torch::empty({}, torch::dtype(torch::kLong).device(torch::kMeta));
  c10::List<std::optional<at::Tensor>> grads(
      {torch::empty({2}, torch::device(torch::kMeta))});
  auto backward = backward_op();
  const auto f32 = static_cast<int64_t>(at::kFloat);
  const auto cpu = static_cast<int64_t>(c10::DeviceType::CPU);
  // Well formed: one 1-d float input of size 2.
  auto ok = backward.call(leaf.id(), state, grads, meta({f32, cpu, -1, 1, 2}));
  ASSERT_EQ(ok.size(), 1u);
  EXPECT_EQ(ok[0].sizes(), at::IntArrayRef({2}));
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({f32, cpu})),
      "shorter than its 4-entry header");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({f32, cpu, -1, 1000, 2})),
      "ndim 1000 does not fit");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({f32, cpu, -1, -1})),
      "ndim -1 does not fit");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({999, cpu, -1, 0})),
      "unknown dtype code 999");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({f32, 4096, -1, 0})),
      "unknown device type code 4096");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({f32, cpu, -1, 1, -3})),
      "negative size -3");
  // The message names the leaf.
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), state, grads, meta({f32})), leaf.name());
}

TEST(Operators, CarriedIntsAreCheckedAgainstTheFakes) {
  // A compiled Python leaf call returns an int as the size of a zero-stride
  // carrier; the graph passes the fake's int, which it uses downstream.
  using CheckSig = void(c10::string_view, const at::Tensor&, c10::SymInt, bool);
  auto check = c10::Dispatcher::singleton()
                   .findSchemaOrThrow("torchleaf::check_carried_int", "")
                   .typed<CheckSig>();
  auto carrier = [](int64_t size) {
    return torch::empty_strided({size}, {0}, torch::kLong);
  };
  check.call("mylib.f", carrier(5), c10::SymInt(5), false);
  EXPECT_THROW_WITH(
      check.call("mylib.f", carrier(6), c10::SymInt(5), false),
      "leaf function 'mylib.f' returned the int 6 where its fake implementation returned 5");
  // Zigzag-coded (an int whose sign the trace could not know): 2n, -2n - 1.
  check.call("mylib.f", carrier(7), c10::SymInt(7), true);
  EXPECT_THROW_WITH(
      check.call("mylib.f", carrier(7), c10::SymInt(6), true),
      "returned the int -4 where its fake implementation returned 3");
  EXPECT_THROW_WITH(
      check.call(
          "mylib.f", torch::zeros({}, torch::kLong), c10::SymInt(0), false),
      "got a 0-d int carrier");
}

TEST(Operators, SymbolicOutputSizesAreCheckedAgainstTheFakes) {
  using CheckSig =
      void(c10::string_view, int64_t, const at::Tensor&, c10::SymIntArrayRef);
  auto check = c10::Dispatcher::singleton()
                   .findSchemaOrThrow("torchleaf::check_output_sizes", "")
                   .typed<CheckSig>();
  const std::vector<c10::SymInt> four_by_two{c10::SymInt(4), c10::SymInt(2)};
  check.call("mylib.f", 1, torch::empty({4, 2}), four_by_two);
  EXPECT_THROW_WITH(
      check.call("mylib.f", 1, torch::empty({3, 2}), four_by_two),
      "leaf function 'mylib.f' output 1 has shape [3, 2] but its fake implementation "
      "returned shape [4, 2]");
  EXPECT_THROW_WITH(
      check.call("mylib.f", 0, torch::empty({4}), four_by_two),
      "has shape [4] but");
}

TEST(Operators, StateHandlesAreChecked) {
  auto leaf = square_leaf();
  auto other = square_leaf();
  auto x = torch::randn({3});
  auto [outs, handle] = forward_op().call(leaf.id(), 0, {x}, {0});
  auto [other_outs, other_handle] = forward_op().call(other.id(), 0, {x}, {0});
  c10::List<std::optional<at::Tensor>> grads({torch::ones({3})});
  auto backward = backward_op();

  auto good = backward.call(leaf.id(), handle, grads, {});
  EXPECT_TRUE(torch::allclose(good[0], 2 * x));
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), torch::zeros({}), grads, {}),
      "is not a state handle");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), torch::zeros({2}, torch::kLong), grads, {}),
      "is not a state handle");
  // An int64 scalar that merely holds a live state's number is not a handle.
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), handle.clone(), grads, {}),
      "is not a state handle");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), at::Tensor(), grads, {}),
      "is not a state handle");
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), other_handle, grads, {}),
      "received the state handle of a call of leaf function '" + other.name());
  // A wrong number of gradients.
  c10::List<std::optional<at::Tensor>> two(
      {torch::ones({3}), torch::ones({3})});
  EXPECT_THROW_WITH(
      backward.call(leaf.id(), handle, two, {}),
      "received 2 gradient(s) for 1 output(s)");
  // Still usable, and nothing leaked.
  EXPECT_TRUE(
      torch::allclose(backward.call(leaf.id(), handle, grads, {})[0], 2 * x));
  handle.reset();
  other_handle.reset();
  EXPECT_EQ(torchleaf::live_states(), 0);
}

// torchleaf::stack_handles: the batched state of a per-sample loop. Each
// element (a view of the stacked handle) replays its own call's graph; the
// states live as long as the stacked handle; anything else is an error.
// A graph owns its operators' outputs (Inductor computes later kernels in
// place in a dead one's buffer), so an output the real function does not
// own -- a table it keeps, an input -- reaches the graph as a copy.
TEST(Operators, OutputsHeldElsewhereReachGraphsAsCopies) {
  auto table = torch::arange(4.0);
  auto leaf = torchleaf::define_leaf(
      unique_name("lookup"),
      [table](const TensorList& in) {
        return TensorList{table, in[0]};
      },
      [](const TensorList& in) {
        return TensorList{at::empty_like(in[0]), at::empty_like(in[0])};
      });
  for (bool requires_grad : {false, true}) {
    auto x = torch::randn({4}).requires_grad_(requires_grad);
    auto [outs, handle] = forward_op().call(leaf.id(), 0, {x}, {0});
    EXPECT_TRUE(torch::equal(outs[0], table));
    EXPECT_NE(outs[0].data_ptr(), table.data_ptr());
    EXPECT_TRUE(torch::equal(outs[1], x));
    EXPECT_NE(outs[1].data_ptr(), x.data_ptr());
  }
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Operators, StackedHandlesReplayEachCall) {
  auto leaf = square_leaf();
  auto stack = c10::Dispatcher::singleton()
                   .findSchemaOrThrow("torchleaf::stack_handles", "")
                   .typed<at::Tensor(at::TensorList)>();
  auto x0 = torch::randn({3});
  auto x1 = torch::randn({3});
  at::Tensor stacked;
  {
    auto [outs0, h0] = forward_op().call(leaf.id(), 0, {x0}, {0});
    auto [outs1, h1] = forward_op().call(leaf.id(), 0, {x1}, {0});
    stacked = stack.call({h0, h1});
    EXPECT_THROW_WITH(
        stack.call({h0, torch::zeros({}, torch::kLong)}),
        "has no captured state");
    EXPECT_THROW_WITH(
        stack.call({h0, stacked}), "expected state handles of shape");
  }
  EXPECT_EQ(stacked.sizes(), at::IntArrayRef({2}));
  EXPECT_EQ(torchleaf::live_states(), 2); // held by the stacked handle alone
  c10::List<std::optional<at::Tensor>> grads({torch::ones({3})});
  EXPECT_TRUE(torch::allclose(
      backward_op().call(leaf.id(), stacked[1], grads, {})[0], 2 * x1));
  EXPECT_TRUE(torch::allclose(
      backward_op().call(leaf.id(), stacked[0], grads, {})[0], 2 * x0));
  auto meta = stack.call(
      {torch::empty({}, torch::dtype(torch::kLong).device(torch::kMeta))});
  EXPECT_EQ(meta.sizes(), at::IntArrayRef({1}));
  EXPECT_TRUE(meta.is_meta());
  stacked.reset();
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Operators, DifferentiableIndicesAreChecked) {
  auto leaf = square_leaf();
  auto x = torch::randn({3});
  EXPECT_THROW_WITH(
      forward_op().call(leaf.id(), 0, {x}, {3}),
      "differentiable input index 3 is out of range");
  EXPECT_THROW_WITH(
      forward_op().call(leaf.id(), 0, {x}, {-1}),
      "differentiable input index -1 is out of range");
  EXPECT_EQ(torchleaf::live_states(), 0);
}

// A failed definition publishes nothing: the name stays free for a retry.
TEST(Operators, FailedDefinitionLeavesNoTrace) {
  const std::string name = "cpptest_taken::op";
  auto squatter = std::make_unique<torch::Library>(
      torch::Library::FRAGMENT,
      "cpptest_taken",
      std::nullopt,
      __FILE__,
      __LINE__);
  squatter->def("op(Tensor x) -> Tensor");
  auto twice = [](const TensorList& in) { return TensorList{in[0] * 2}; };
  try {
    torchleaf::define_leaf(name, twice);
    ADD_FAILURE() << "defining over an existing operator should fail";
  } catch (const c10::Error& e) {
    EXPECT_EQ(
        std::string(e.what()).find("is already defined"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(torchleaf::find_leaf(name).has_value());
  squatter.reset(); // the operator is gone: now the name is free
  auto leaf = torchleaf::define_leaf(name, twice);
  EXPECT_TRUE(torchleaf::find_leaf(name).has_value());
  EXPECT_TRUE(
      torch::allclose(leaf({torch::ones({2})})[0], torch::full({2}, 2.0)));
}

// torchleaf::forward's Autograd kernel: a compiled graph calls it with grad
// mode off (the unboxed path straight below Autograd); a caller that hands
// it inputs requiring grad gets outputs whose backward is refused with a
// message, since their gradient is the graph's own torchleaf::backward.
TEST(Operators, ForwardRefusesBackwardThroughItsOutputsWhenInputsRequireGrad) {
  auto leaf = square_leaf();
  auto x = torch::randn({3}, torch::requires_grad());
  {
    torch::NoGradGuard no_grad;
    auto [outs, handle] = forward_op().call(leaf.id(), 0, {x}, {0});
    EXPECT_TRUE(torch::allclose(outs[0], x.detach() * x.detach()));
    EXPECT_FALSE(outs[0].requires_grad());
  }
  auto [outs, handle] = forward_op().call(leaf.id(), 0, {x}, {0});
  EXPECT_TRUE(torch::allclose(outs[0].detach(), x.detach() * x.detach()));
  ASSERT_TRUE(outs[0].requires_grad());
  EXPECT_THROW_WITH(
      outs[0].sum().backward(),
      "cannot be differentiated through the outputs of torchleaf::forward");
  c10::List<std::optional<at::Tensor>> grads({torch::ones({3})});
  auto grad = backward_op().call(leaf.id(), handle, grads, {});
  EXPECT_TRUE(torch::allclose(grad[0].detach(), 2 * x.detach()));
  outs.clear();
  handle.reset();
  EXPECT_EQ(torchleaf::live_states(), 0);
}
