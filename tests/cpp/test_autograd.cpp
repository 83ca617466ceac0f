// Autograd through C++ leaves: values and gradients against the plain body,
// per-invocation state, retain_graph, double backward and state lifetimes.
#include "test_util.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <numeric>
#include <thread>

using torchleaf::TensorList;

namespace {

TensorList body(const TensorList& in) {
  // Elementwise, a matmul and a reduction; two outputs.
  auto h = torch::tanh(in[0].matmul(in[1])) * in[0].sum();
  return {h, (h * h).sum(1)};
}

torchleaf::LeafFunction body_leaf() {
  static auto leaf = torchleaf::define_leaf(
      unique_name("body"), body, [](const TensorList& in) {
        auto h = at::empty({in[0].size(0), in[1].size(1)}, in[0].options());
        return TensorList{h, at::empty({in[0].size(0)}, in[0].options())};
      });
  return leaf;
}

TensorList grads_of(
    const TensorList& outs,
    const TensorList& inputs,
    bool create_graph = false) {
  auto loss = outs[0].sin().sum() + outs[1].pow(2).sum();
  return torch::autograd::grad(
      {loss}, inputs, {}, /*retain_graph=*/create_graph, create_graph);
}

} // namespace

TEST(Autograd, GradientsMatchTheBody) {
  auto x =
      torch::randn({3, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto w =
      torch::randn({4, 5}, torch::dtype(torch::kDouble).requires_grad(true));
  auto expected = grads_of(body({x, w}), {x, w});
  auto got = grads_of(body_leaf()({x, w}), {x, w});
  EXPECT_TRUE(torch::allclose(got[0], expected[0]));
  EXPECT_TRUE(torch::allclose(got[1], expected[1]));
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Autograd, GradcheckAndGradgradcheckStyleSecondOrder) {
  // Second derivatives through create_graph=True equal the body's.
  auto x =
      torch::randn({3, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto w =
      torch::randn({4, 5}, torch::dtype(torch::kDouble).requires_grad(true));
  auto g_ref = grads_of(body({x, w}), {x, w}, /*create_graph=*/true);
  auto gg_ref = torch::autograd::grad(
      {(g_ref[0] * g_ref[0]).sum() + g_ref[1].sum()}, {x, w});
  auto g = grads_of(body_leaf()({x, w}), {x, w}, /*create_graph=*/true);
  auto gg = torch::autograd::grad({(g[0] * g[0]).sum() + g[1].sum()}, {x, w});
  EXPECT_TRUE(torch::allclose(g[0], g_ref[0]));
  EXPECT_TRUE(torch::allclose(gg[0], gg_ref[0]));
  EXPECT_TRUE(torch::allclose(gg[1], gg_ref[1]));
}

TEST(Autograd, TwoForwardsInFlightKeepTheirOwnState) {
  auto leaf = body_leaf();
  auto w =
      torch::randn({4, 5}, torch::dtype(torch::kDouble).requires_grad(true));
  auto x1 = torch::randn({3, 4}, torch::kDouble);
  auto x2 = torch::randn({3, 4}, torch::kDouble);
  auto o1 = leaf({x1, w});
  auto o2 = leaf({x2, w});
  (o1[0].sum() + o1[1].sum()).backward();
  auto g1 = w.grad().clone();
  (o2[0].sum() + o2[1].sum()).backward();
  auto g2 = w.grad() - g1;
  EXPECT_EQ(torchleaf::live_states(), 0);

  auto wr = w.detach().clone().requires_grad_(true);
  auto r1 = body({x1, wr});
  (r1[0].sum() + r1[1].sum()).backward();
  auto e1 = wr.grad().clone();
  auto r2 = body({x2, wr});
  (r2[0].sum() + r2[1].sum()).backward();
  EXPECT_TRUE(torch::allclose(g1, e1));
  EXPECT_TRUE(torch::allclose(g2, wr.grad() - e1));
}

TEST(Autograd, RetainGraphAccumulatesAndReleasedStateIsAClearError) {
  auto leaf = body_leaf();
  auto x =
      torch::randn({3, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto w = torch::randn({4, 5}, torch::kDouble);
  auto out = leaf({x, w});
  auto loss = out[0].sum();
  loss.backward({}, /*retain_graph=*/true);
  auto once = x.grad().clone();
  loss.backward();
  EXPECT_TRUE(torch::allclose(x.grad(), 2 * once));
  EXPECT_EQ(torchleaf::live_states(), 0);
  EXPECT_THROW_WITH(
      loss.backward(), "backward through the graph a second time");
}

TEST(Autograd, UnusedInputGetsNoGradientAndIntegerOutputsAreNotDifferentiable) {
  auto leaf = torchleaf::define_leaf(
      unique_name("partial"),
      [](const TensorList& in) {
        return TensorList{
            in[0] * 2, in[0].argmax(), torch::ones({2}, in[0].options())};
      },
      [](const TensorList& in) {
        return TensorList{
            at::empty_like(in[0]),
            at::empty({}, in[0].options().dtype(at::kLong)),
            at::empty({2}, in[0].options())};
      });
  auto x = torch::randn({3}, torch::requires_grad(true));
  auto unused = torch::randn({2, 2}, torch::requires_grad(true));
  auto out = leaf({x, unused});
  EXPECT_FALSE(out[1].requires_grad());
  // Depends on no input: does not require grad, as with the plain function.
  EXPECT_FALSE(out[2].requires_grad());
  // As with the plain function: no gradient for the unused input (undefined
  // with allow_unused, an error without).
  auto g = torch::autograd::grad(
      {out[0].sum() + out[2].sum()},
      {x, unused},
      /*grad_outputs=*/{},
      /*retain_graph=*/true,
      /*create_graph=*/false,
      /*allow_unused=*/true);
  EXPECT_TRUE(torch::allclose(g[0], torch::full({3}, 2.0)));
  EXPECT_FALSE(g[1].defined());
  EXPECT_THROW(torch::autograd::grad({out[0].sum()}, {x, unused}), c10::Error);
}

TEST(Autograd, EagerCallsKeepNoState) {
  auto leaf = body_leaf();
  auto x = torch::randn({3, 4}, torch::requires_grad(true));
  auto w = torch::randn({4, 5});
  for (int i = 0; i < 2000; ++i) {
    auto out = leaf({x, w});
    EXPECT_EQ(torchleaf::live_states(), 0);
    if (i % 2 == 0) {
      out[0].sum().backward();
    }
  }
}

// The operators tracers record: torchleaf::forward returns a state handle
// that owns the captured graph; torchleaf::backward replays it (any number of
// times) and the state goes when the handle goes.
TEST(Autograd, ForwardAndBackwardOperatorsOwnTheStateThroughTheHandle) {
  auto leaf = body_leaf();
  auto forward = c10::Dispatcher::singleton()
                     .findSchemaOrThrow("torchleaf::forward", "")
                     .typed<std::tuple<TensorList, at::Tensor>(
                         int64_t, int64_t, at::TensorList, at::IntArrayRef)>();
  auto backward = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("torchleaf::backward", "")
                      .typed<TensorList(
                          int64_t,
                          const at::Tensor&,
                          const c10::List<std::optional<at::Tensor>>&,
                          c10::SymIntArrayRef)>();
  auto x = torch::randn({3, 4}, torch::kDouble);
  auto w = torch::randn({4, 5}, torch::kDouble);
  auto [outs, handle] = forward.call(leaf.id(), /*plan=*/0, {x, w}, {0, 1});
  EXPECT_EQ(torchleaf::live_states(), 1);
  EXPECT_FALSE(outs[0].requires_grad());
  auto g0 = torch::randn({3, 5}, torch::kDouble);
  c10::List<std::optional<at::Tensor>> grads({g0, std::nullopt});
  auto first = backward.call(leaf.id(), handle, grads, {});
  auto second = backward.call(leaf.id(), handle, grads, {}); // never frees
  auto xr = x.clone().requires_grad_(true);
  auto wr = w.clone().requires_grad_(true);
  auto expected = torch::autograd::grad({body({xr, wr})[0]}, {xr, wr}, {g0});
  ASSERT_EQ(first.size(), 2u);
  EXPECT_TRUE(torch::allclose(first[0], expected[0]));
  EXPECT_TRUE(torch::allclose(first[1], expected[1]));
  EXPECT_TRUE(torch::allclose(second[1], expected[1]));
  {
    auto copy = handle; // a copy shares the storage: still one state
    handle.reset();
    EXPECT_EQ(torchleaf::live_states(), 1);
  }
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Autograd, EscapedGradientsAreReportedOrIgnored) {
  auto closure = torch::randn({3}, torch::requires_grad(true));
  const auto name = unique_name("escapes");
  auto leaf = torchleaf::define_leaf(
      name,
      [closure](const TensorList& in) { return TensorList{in[0] * closure}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  auto x = torch::randn({3}, torch::requires_grad(true));
  EXPECT_THROW_WITH(
      leaf({x}),
      "uses 1 tensor(s) that require grad but are not among its inputs");
  EXPECT_EQ(torchleaf::live_states(), 0);

  auto lax = torchleaf::define_leaf(
      unique_name("escapes_ok"),
      [closure](const TensorList& in) { return TensorList{in[0] * closure}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().check_escaped(false));
  auto out = lax({x});
  out[0].sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), closure.detach()));
  EXPECT_FALSE(closure.grad().defined()); // not computed, as documented
}

// The body sees its own alias of each input: requires_grad_() on one the
// caller passed without grad makes a leaf whose gradient has nowhere to go,
// named as the input it is, with or without other inputs that require grad.
TEST(Autograd, AnInputMadeToRequireGradInsideIsNamed) {
  auto leaf = torchleaf::define_leaf(
      unique_name("grad_inside"),
      [](const TensorList& in) {
        in[1].requires_grad_();
        return TensorList{in[0] * in[1]};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  const auto w = torch::ones({3});
  EXPECT_THROW_WITH(
      leaf({torch::ones({3}, torch::requires_grad(true)), w}),
      "called requires_grad_() on its input 1 (flattened position) inside the function");
  EXPECT_THROW_WITH(
      leaf({torch::ones({3}), w}),
      "called requires_grad_() on its input 1 (flattened position) inside the function");
  EXPECT_FALSE(w.requires_grad());
  EXPECT_EQ(torchleaf::live_states(), 0);
}

namespace {

// A traced call (torchleaf::forward, then torchleaf::backward), as compiled
// graphs make it.
std::tuple<TensorList, at::Tensor> traced_forward(
    const torchleaf::LeafFunction& leaf,
    const TensorList& inputs) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchleaf::forward", "")
          .typed<std::tuple<TensorList, at::Tensor>(
              int64_t, int64_t, at::TensorList, at::IntArrayRef)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<int64_t> differentiable(inputs.size());
  std::iota(differentiable.begin(), differentiable.end(), 0);
  return op.call(leaf.id(), 0, inputs, differentiable);
}

TensorList traced_backward(
    const torchleaf::LeafFunction& leaf,
    const at::Tensor& state,
    const at::Tensor& grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::backward", "")
                       .typed<TensorList(
                           int64_t,
                           const at::Tensor&,
                           const c10::List<std::optional<at::Tensor>>&,
                           c10::SymIntArrayRef)>();
  c10::List<std::optional<at::Tensor>> grads;
  grads.push_back(grad);
  return op.call(leaf.id(), state, grads, {});
}

// `w` times 1, `n` times: a chain of caller's nodes, made on this thread.
at::Tensor chain(const at::Tensor& w, int n) {
  auto h = w;
  for (int i = 0; i < n; ++i) {
    h = h * 1.0;
  }
  return h;
}

} // namespace

// The walk that decides which nodes belong to a call recognizes a leaf
// tensor's AccumulateGrad by its sequence number (UINT64_MAX) before a
// dynamic_cast. If PyTorch numbered them otherwise, an output that is a leaf
// made inside the function would be reported as an escaped tensor: this
// breaks first.
TEST(Autograd, LeafTensorsMadeInsideAreOutputsNotEscapes) {
  auto made = torch::randn({3}, torch::requires_grad(true));
  ASSERT_EQ(
      torch::autograd::impl::grad_accumulator(made)->sequence_nr(), UINT64_MAX);

  auto leaf = torchleaf::define_leaf(
      unique_name("makes_a_leaf"),
      [](const TensorList& in) {
        return TensorList{
            in[0] * 2, torch::ones({3}, torch::requires_grad(true))};
      },
      [](const TensorList& in) {
        return TensorList{
            at::empty_like(in[0]), at::empty({3}, in[0].options())};
      });
  auto x = torch::randn({3}, torch::requires_grad(true));
  auto out = leaf({x}); // with the escaped-gradient check on
  (out[0].sum() + out[1].sum()).backward();
  EXPECT_TRUE(torch::allclose(x.grad(), torch::full({3}, 2.0)));
}

// The function sees detached aliases of its inputs that share their version
// counters, with or without autograd recording: an undeclared in-place
// change is caught either way, and the caller's tensor saw it.
TEST(Autograd, InputAliasesShareTheCallersVersionCounter) {
  auto sneaky = torchleaf::define_leaf(
      unique_name("sneaky_recorded"),
      [](const TensorList& in) {
        auto h = in[0] * 1;
        in[1].add_(1);
        return TensorList{h};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  auto x = torch::ones({2}, torch::requires_grad(true));
  auto y = torch::ones({2});
  EXPECT_THROW_WITH(sneaky({x, y}), "mutated its input 1");
  EXPECT_TRUE(torch::allclose(y, torch::full({2}, 2.0)));
  auto z = torch::ones({2}).requires_grad_();
  auto z_view =
      z * 1; // a non-leaf requiring grad: the aliased input is captured
  EXPECT_THROW_WITH(sneaky({y, z_view}), "mutated its input 1");
  // Views of one tensor share its version counter: the message names both.
  auto base = torch::ones({4});
  EXPECT_THROW_WITH(
      sneaky({base.narrow(0, 0, 2), base.narrow(0, 2, 2)}),
      "mutated its input 0 (flattened position) or one of the inputs that are views of the same tensor (1)");
  EXPECT_EQ(torchleaf::live_states(), 0);
}

// Sequence numbers count per thread. A closure tensor whose graph another
// thread built has numbers unrelated to the call's; with the escaped-gradient
// check off, the walk must still cut only the call's own edge to it, never an
// edge inside the caller's graph (which lost w's gradient for the caller's
// own backward).
TEST(Autograd, ClosureBuiltOnAnotherThreadKeepsTheCallersGraph) {
  auto w = torch::randn({3}, torch::dtype(torch::kDouble).requires_grad(true));
  at::Tensor h;
  std::thread([&] { h = chain(w, 50); }).join();
  auto leaf = torchleaf::define_leaf(
      unique_name("thread_closure"),
      [h](const TensorList& in) { return TensorList{in[0] * h}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().check_escaped(false));
  auto x = torch::randn({3}, torch::dtype(torch::kDouble).requires_grad(true));

  for (bool traced : {false, true}) {
    SCOPED_TRACE(traced ? "traced" : "eager");
    w.mutable_grad() = at::Tensor();
    x.mutable_grad() = at::Tensor();
    TensorList out;
    at::Tensor state;
    if (traced) {
      std::tie(out, state) = traced_forward(leaf, {x});
    } else {
      out = leaf({x});
    }
    EXPECT_TRUE(torch::allclose(out[0], x * h));
    // The caller's own graph is whole.
    h.sum().backward({}, /*retain_graph=*/true);
    ASSERT_TRUE(w.grad().defined());
    EXPECT_TRUE(torch::allclose(w.grad(), torch::ones_like(w)));
    // The call's gradient reaches x only (w's is dropped knowingly).
    auto ones = torch::ones_like(x);
    auto gx = traced ? traced_backward(leaf, state, ones)[0]
                     : torch::autograd::grad({out[0]}, {x}, {ones})[0];
    EXPECT_TRUE(torch::allclose(gx, h.detach()));
    EXPECT_TRUE(torch::allclose(w.grad(), torch::ones_like(w)));
  }
  EXPECT_EQ(torchleaf::live_states(), 0);
}

// The other direction: nodes the function makes on a worker thread have
// sequence numbers below the call's; they lead to the inputs, so they are
// the call's (not escaped tensors) and the input's gradient flows.
TEST(Autograd, NodesMadeOnAWorkerThreadBelongToTheCall) {
  auto leaf = torchleaf::define_leaf(
      unique_name("worker_thread"),
      [](const TensorList& in) {
        at::Tensor y;
        std::thread([&] { y = in[0] * 3.0; }).join();
        return TensorList{y.sin()};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  auto x = torch::randn({4}, torch::dtype(torch::kDouble).requires_grad(true));
  chain(x, 200); // this thread's sequence numbers run ahead of the worker's
  auto expected = torch::autograd::grad({(x * 3.0).sin().sum()}, {x})[0];

  auto out = leaf({x});
  EXPECT_TRUE(torch::allclose(out[0], (x * 3.0).sin()));
  EXPECT_TRUE(
      torch::allclose(torch::autograd::grad({out[0].sum()}, {x})[0], expected));

  auto [traced_out, state] = traced_forward(leaf, {x});
  auto gx = traced_backward(leaf, state, torch::ones_like(x))[0];
  EXPECT_TRUE(torch::allclose(gx, expected));
  state.reset();
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Autograd, CallerUnderNoGradGetsNoGraph) {
  auto leaf = body_leaf();
  auto x = torch::randn({3, 4}, torch::requires_grad(true));
  auto w = torch::randn({4, 5});
  torch::NoGradGuard no_grad;
  auto out = leaf({x, w});
  EXPECT_FALSE(out[0].requires_grad());
  EXPECT_EQ(torchleaf::live_states(), 0);
}

// An eager call gives the function its leaf inputs (parameters) as they are,
// as the plain function gets them: gradients accumulate from the function's
// own graph, one tensor passed twice beside an activation included, and a
// body that runs backward through its parameter (a step of training inside)
// accumulates into its .grad as the plain body does.
TEST(Autograd, LeafInputsAreTheCallersOwnTensors) {
  auto trains = [](const TensorList& in) {
    in[0].pow(2).sum().backward();
    return TensorList{(in[0] * in[1] * in[2]).sin()};
  };
  auto leaf = torchleaf::define_leaf(
      unique_name("trains"), trains, [](const TensorList& in) {
        return TensorList{at::empty_like(in[0])};
      });
  auto w = torch::randn({3}, torch::dtype(torch::kDouble).requires_grad(true));
  auto x = torch::randn({3}, torch::dtype(torch::kDouble).requires_grad(true));
  auto grads = [&](auto&& f) {
    w.mutable_grad() = at::Tensor();
    x.mutable_grad() = at::Tensor();
    auto h = x * 2; // an activation: not a leaf
    auto inside = f(TensorList{w, h, w})[0];
    auto w_grad_inside = w.grad().clone();
    inside.sum().backward();
    return TensorList{w_grad_inside, w.grad(), x.grad()};
  };
  auto expected = grads(trains);
  auto got = grads(leaf);
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i], expected[i])) << i;
  }
  EXPECT_EQ(torchleaf::live_states(), 0);
}

// A hook the function puts on its input (gradient scaling inside the body)
// runs in backward, as it does for the plain body: eager calls used to wire
// the captured graph past the input's node, which holds the hook.
TEST(Autograd, AHookTheFunctionPutsOnItsInputRuns) {
  auto scaled = [](const TensorList& in) {
    in[0].register_hook([](const at::Tensor& g) { return g * 10; });
    return TensorList{(in[0] * in[1]).sin()};
  };
  auto leaf = torchleaf::define_leaf(
      unique_name("scaled"), scaled, [](const TensorList& in) {
        return TensorList{at::empty_like(in[0])};
      });
  auto x = torch::randn({3}, torch::dtype(torch::kDouble));
  auto w = torch::randn({3}, torch::dtype(torch::kDouble));
  auto grads = [&](auto&& f) {
    auto xs = x.clone().requires_grad_(true);
    auto ws = w.clone().requires_grad_(true);
    f(TensorList{xs, ws})[0].sum().backward();
    return TensorList{xs.grad(), ws.grad()};
  };
  auto expected = grads(scaled);
  auto got = grads(leaf);
  EXPECT_TRUE(torch::allclose(got[0], expected[0]));
  EXPECT_TRUE(torch::allclose(got[1], expected[1]));
  EXPECT_EQ(torchleaf::live_states(), 0);
}
