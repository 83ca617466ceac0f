// The inline replay of captured graphs (capture.cpp, replay_inline) against
// torch::autograd::Engine::execute: the same captured graph replayed both
// ways gives the same gradients, for every graph shape a leaf can build, and
// every engine feature the inline path does not implement routes to the
// engine. A probe node in each graph records which path ran it: the inline
// path runs nodes outside any graph task (or inside the enclosing backward's),
// the engine in a graph task of its own.
#include "test_util.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "csrc/replay.h" // TORCHLEAF_INLINE_REPLAY_SUPPORTED, runs_without_python
#include "csrc/torch_private.h"

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
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

// The graph task the probe's backward last ran in (-1: none), and how often.
std::atomic<int> g_probe_task{-2};
std::atomic<int> g_probe_runs{0};
std::atomic<at::ScalarType> g_probe_grad_dtype{at::ScalarType::Undefined};

// Identity whose backward records the graph task it runs in.
struct Probe : public torch::autograd::Function<Probe> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    g_probe_task = torchleaf::torch_private::current_graph_task_id();
    g_probe_grad_dtype = grads[0].scalar_type();
    ++g_probe_runs;
    return grads;
  }
};

at::Tensor probe(const at::Tensor& x) {
  return Probe::apply(x);
}

// Restores the process-wide switch whatever a test does.
struct InlineReplayGuard {
  InlineReplayGuard() : saved_(torchleaf::Config::inline_replay()) {}
  ~InlineReplayGuard() {
    torchleaf::Config::set_inline_replay(saved_);
  }

 private:
  bool saved_;
};

constexpr bool kInlineSupported = TORCHLEAF_INLINE_REPLAY_SUPPORTED;

enum class Path { Inline, Engine };

// A traced call's forward: the outputs and the handle of the captured graph.
std::tuple<TensorList, at::Tensor> forward(
    const torchleaf::LeafFunction& leaf,
    const TensorList& inputs,
    const std::vector<int64_t>& differentiable) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::forward", "")
                       .typed<ForwardSig>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(leaf.id(), 0, inputs, differentiable);
}

// One replay of the captured graph `state`; `path` says which path must run
// it (the probe must be in the graph).
TensorList replay(
    const torchleaf::LeafFunction& leaf,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads,
    bool inline_replay,
    Path expected) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::backward", "")
                       .typed<BackwardSig>();
  InlineReplayGuard restore;
  torchleaf::Config::set_inline_replay(inline_replay);
  const int runs = g_probe_runs;
  c10::List<std::optional<at::Tensor>> g;
  for (const auto& t : grads) {
    g.push_back(t);
  }
  TensorList out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out =
        op.call(leaf.id(), state, g, {}); // the real kernel needs no input_meta
  }
  EXPECT_EQ(g_probe_runs, runs + 1)
      << "the probe must be in the replayed graph";
  if (expected == Path::Inline) {
    EXPECT_EQ(g_probe_task, -1) << "expected the inline replay";
  } else {
    EXPECT_NE(g_probe_task, -1) << "expected Engine::execute";
  }
  return out;
}

void expect_same(
    const TensorList& a,
    const TensorList& b,
    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " gradient " << i;
    if (!a[i].defined()) {
      continue;
    }
    EXPECT_EQ(a[i].scalar_type(), b[i].scalar_type())
        << what << " gradient " << i;
    EXPECT_EQ(a[i].sizes(), b[i].sizes()) << what << " gradient " << i;
    EXPECT_TRUE(torch::allclose(a[i], b[i]))
        << what << " gradient " << i << ":\n"
        << a[i] << "\nvs\n"
        << b[i];
  }
}

// Captures `body` once, replays the same graph inline and through the engine
// (twice each way: replay never frees the graph) and checks both against the
// gradients plain autograd computes for `body`.
void compare(
    const std::string& base,
    std::function<TensorList(const TensorList&)> body,
    const TensorList& inputs,
    const std::vector<int64_t>& differentiable,
    const std::vector<std::optional<at::Tensor>>& grads) {
  SCOPED_TRACE(base);
  auto leaf = torchleaf::define_leaf(unique_name(base), body);
  auto [outputs, state] = forward(leaf, inputs, differentiable);
  ASSERT_EQ(outputs.size(), grads.size());

  const Path inline_path = kInlineSupported ? Path::Inline : Path::Engine;
  auto inlined = replay(leaf, state, grads, true, inline_path);
  auto engine = replay(leaf, state, grads, false, Path::Engine);
  expect_same(inlined, engine, "inline vs engine");
  expect_same(
      replay(leaf, state, grads, true, inline_path),
      inlined,
      "inline, replayed again");
  expect_same(
      replay(leaf, state, grads, false, Path::Engine),
      engine,
      "engine, replayed again");

  // Ground truth: the body's own graph. Inputs the outputs do not reach get
  // zeros from replay (a traced backward expects a tensor per input).
  TensorList leaves;
  for (const auto& t : inputs) {
    leaves.push_back(t.detach().requires_grad_(t.is_floating_point()));
  }
  auto ref_out = body(leaves);
  TensorList roots;
  TensorList root_grads;
  for (size_t k = 0; k < ref_out.size(); ++k) {
    if (grads[k].has_value() && ref_out[k].requires_grad()) {
      roots.push_back(ref_out[k]);
      root_grads.push_back(*grads[k]);
    }
  }
  TensorList wrt;
  for (auto i : differentiable) {
    wrt.push_back(leaves[i]);
  }
  auto ref = torch::autograd::grad(
      roots, wrt, root_grads, false, false, /*allow_unused=*/true);
  for (size_t k = 0; k < ref.size(); ++k) {
    if (!ref[k].defined()) {
      ref[k] = torch::zeros_like(wrt[k]);
    }
  }
  expect_same(engine, ref, "engine vs plain autograd");
}

at::Tensor randn(at::IntArrayRef sizes) {
  return torch::randn(sizes, torch::kDouble);
}

} // namespace

TEST(Replay, InlineAndEngineAgreeOnAChain) {
  compare(
      "chain",
      [](const TensorList& in) {
        return TensorList{probe((in[0] * 2).sin() * in[0].exp()).tanh().sum(0)};
      },
      {randn({3, 4})},
      {0},
      {randn({4})});
}

TEST(Replay, InlineAndEngineAgreeOnADiamondAccumulatingIntoOneInput) {
  // x reaches the output along four paths; w along two.
  compare(
      "diamond",
      [](const TensorList& in) {
        auto a = probe(in[0]);
        auto b = a.sin() * in[1];
        auto c = a.cos() + in[1];
        return TensorList{b * c + a + in[0] * 3};
      },
      {randn({5}), randn({5})},
      {0, 1},
      {randn({5})});
}

TEST(Replay, InlineAndEngineAgreeOnMultipleOutputsWithSomeGradientsMissing) {
  compare(
      "multi_out",
      [](const TensorList& in) {
        auto h = probe(in[0] * in[1]);
        return TensorList{h.sin(), h * 2, in[1].exp(), h.sum()};
      },
      {randn({4}), randn({4})},
      {0, 1},
      {randn({4}), std::nullopt, randn({4}), std::nullopt});
}

TEST(Replay, InlineAndEngineAgreeOnMultiOutputNodesWithPartialGradients) {
  // SplitBackward and UnbindBackward receive undefined gradients for the
  // pieces nobody uses.
  compare(
      "split",
      [](const TensorList& in) {
        auto pieces = probe(in[0]).split(2);
        auto rows = in[0].unbind(0);
        return TensorList{pieces[0] * 3, pieces[2].sin(), rows[1].exp()};
      },
      {randn({6, 3})},
      {0},
      {randn({2, 3}), randn({2, 3}), std::nullopt});
}

TEST(Replay, UnusedInputsGetZerosOnBothPaths) {
  compare(
      "unused",
      [](const TensorList& in) { return TensorList{probe(in[0]) * 2}; },
      {randn({3}), randn({2, 2})},
      {0, 1},
      {randn({3})});
}

TEST(Replay, IntegerOutputsAndInputs) {
  // Integer outputs have no gradient edge; an integer input is not
  // differentiable.
  compare(
      "integer",
      [](const TensorList& in) {
        auto h = probe(in[0] * in[1].to(at::kDouble));
        return TensorList{(h > 0).to(at::kLong), h.sin(), h.argmax()};
      },
      {randn({4}), torch::arange(4)},
      {0},
      {std::nullopt, randn({4}), std::nullopt});
}

TEST(Replay, ViewsAndInPlaceOnViews) {
  compare(
      "views",
      [](const TensorList& in) {
        auto h = probe(in[0] * 2);
        auto t = h.transpose(0, 1);
        auto row = h.select(0, 1);
        auto c = in[0].clone();
        c.select(0, 0).mul_(in[1]); // CopySlices
        c.narrow(1, 1, 2).add_(row.narrow(0, 0, 2));
        return TensorList{t, row, c.view({-1}), h.as_strided({2, 2}, {1, 3})};
      },
      {randn({3, 3}), randn({3})},
      {0, 1},
      {randn({3, 3}), randn({3}), randn({9}), randn({2, 2})});
}

TEST(Replay, RootGradientsAreValidatedAsTheEngineDoes) {
  // A float output gets a double gradient of a broadcastable shape: the
  // engine casts and sums it before it enters the graph, and so must the
  // inline path (the probe is the output's node and sees what enters).
  auto body = [](const TensorList& in) {
    return TensorList{probe(in[0].to(at::kFloat).sin())};
  };
  compare("root_dtype", body, {randn({4})}, {0}, {randn({2, 4})});
  auto leaf = torchleaf::define_leaf(unique_name("root_dtype"), body);
  auto [outputs, state] = forward(leaf, {randn({4})}, {0});
  for (bool inline_replay : {true, false}) {
    g_probe_grad_dtype = at::ScalarType::Undefined;
    replay(
        leaf,
        state,
        {randn({2, 4})},
        inline_replay,
        inline_replay && kInlineSupported ? Path::Inline : Path::Engine);
    EXPECT_EQ(g_probe_grad_dtype, at::kFloat)
        << "inline_replay=" << inline_replay;
  }
  // A shape that does not broadcast is the engine's error on both paths.
  for (bool inline_replay : {true, false}) {
    InlineReplayGuard restore;
    torchleaf::Config::set_inline_replay(inline_replay);
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchleaf::backward", "")
                         .typed<BackwardSig>();
    c10::List<std::optional<at::Tensor>> g(
        {std::optional<at::Tensor>(randn({3}))});
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    EXPECT_THROW_WITH(
        op.call(leaf.id(), state, g, {}), "invalid gradient at index 0");
  }
}

TEST(Replay, LargeGraphsGoToTheEngine) {
  auto leaf =
      torchleaf::define_leaf(unique_name("large"), [](const TensorList& in) {
        auto h = probe(in[0]);
        for (int i = 0; i < 40; ++i) {
          h = h * 1.01 + 0.1;
        }
        return TensorList{h};
      });
  auto [outputs, state] = forward(leaf, {randn({3})}, {0});
  auto a = replay(leaf, state, {randn({3})}, true, Path::Engine);
  auto b = replay(leaf, state, {a[0]}, false, Path::Engine);
  EXPECT_EQ(b[0].sizes(), a[0].sizes());
}

TEST(Replay, AnomalyModeGoesToTheEngine) {
  auto leaf = torchleaf::define_leaf(
      unique_name("anomaly"),
      [](const TensorList& in) { return TensorList{probe(in[0]).sin()}; });
  auto x = randn({3});
  auto [outputs, state] = forward(leaf, {x}, {0});
  torch::autograd::DetectAnomalyGuard anomaly;
  auto g = replay(
      leaf, state, {torch::ones({3}, torch::kDouble)}, true, Path::Engine);
  EXPECT_TRUE(torch::allclose(g[0], x.cos()));
}

namespace {

struct Doubling : public torch::autograd::FunctionPreHook {
  variable_list operator()(const variable_list& grads) override {
    variable_list out;
    for (const auto& g : grads) {
      out.push_back(g.defined() ? g * 2 : g);
    }
    return out;
  }
};

struct CountingPostHook : public torch::autograd::FunctionPostHook {
  explicit CountingPostHook(int* count) : count_(count) {}
  variable_list operator()(
      const variable_list& outputs,
      const variable_list& /*inputs*/) override {
    ++*count_;
    return outputs;
  }
  int* count_;
};

// Replays a captured f(x) = 3 * probe(g(x)) with inline replay on, where
// `hook` installs something on g's output inside the real function;
// returns d/dx.
at::Tensor replay_with(
    const std::string& base,
    std::function<void(at::Tensor&)> hook,
    const at::Tensor& x) {
  auto leaf =
      torchleaf::define_leaf(unique_name(base), [hook](const TensorList& in) {
        auto h = in[0].sin();
        hook(h);
        return TensorList{probe(h) * 3};
      });
  auto [outputs, state] = forward(leaf, {x}, {0});
  return replay(leaf, state, {torch::ones_like(x)}, true, Path::Engine)[0];
}

} // namespace

TEST(Replay, TensorHooksGoToTheEngine) {
  auto x = randn({3});
  auto g = replay_with(
      "tensor_hook",
      [](at::Tensor& h) {
        h.register_hook([](const at::Tensor& grad) { return grad * 2; });
      },
      x);
  EXPECT_TRUE(torch::allclose(g, 6 * x.cos())); // the hook ran
}

TEST(Replay, NodePreAndPostHooksGoToTheEngine) {
  auto x = randn({3});
  auto g = replay_with(
      "pre_hook",
      [](at::Tensor& h) {
        h.grad_fn()->add_pre_hook(std::make_unique<Doubling>());
      },
      x);
  EXPECT_TRUE(torch::allclose(g, 6 * x.cos()));
  int posts = 0;
  g = replay_with(
      "post_hook",
      [&posts](at::Tensor& h) {
        h.grad_fn()->add_post_hook(std::make_unique<CountingPostHook>(&posts));
      },
      x);
  EXPECT_TRUE(torch::allclose(g, 3 * x.cos()));
  EXPECT_EQ(posts, 1);
}

TEST(Replay, RetainGradGoesToTheEngine) {
  auto x = randn({3});
  at::Tensor retained;
  auto g = replay_with(
      "retain_grad",
      [&retained](at::Tensor& h) {
        h.retain_grad();
        retained = h;
      },
      x);
  EXPECT_TRUE(torch::allclose(g, 3 * x.cos()));
  ASSERT_TRUE(retained.grad().defined());
  EXPECT_TRUE(
      torch::allclose(retained.grad(), torch::full({3}, 3.0, torch::kDouble)));
}

namespace {

// A node whose backward is a lambda.
struct LambdaNode : public torch::autograd::Node {
  explicit LambdaNode(std::function<variable_list(variable_list&&)> fn)
      : fn_(std::move(fn)) {}
  variable_list apply(variable_list&& grads) override {
    return fn_(std::move(grads));
  }
  std::function<variable_list(variable_list&&)> fn_;
};

} // namespace

TEST(Replay, NonCpuGraphsGoToTheEngine) {
  // CPU output <- a node on the meta device <- the input: the graph is not
  // all CPU, so the inline path must leave it to the engine. (The meta
  // device stands in for an accelerator; the root stays on the CPU so that
  // the dispatcher picks torchleaf::backward's real kernel.)
  auto leaf =
      torchleaf::define_leaf(unique_name("non_cpu"), [](const TensorList& in) {
        const auto meta = torch::dtype(torch::kDouble).device(torch::kMeta);
        auto on_meta = torchleaf::torch_private::make_node<LambdaNode>(
            [](variable_list&&) {
              g_probe_task = torchleaf::torch_private::current_graph_task_id();
              ++g_probe_runs;
              return variable_list{torch::ones({2}, torch::kDouble)};
            });
        on_meta->set_next_edges(torch::autograd::collect_next_edges(in[0]));
        auto mid = torch::empty({2}, meta);
        torch::autograd::set_history(mid, on_meta);
        auto to_meta = torchleaf::torch_private::make_node<LambdaNode>(
            [meta](variable_list&&) {
              return variable_list{torch::empty({2}, meta)};
            });
        to_meta->set_next_edges(torch::autograd::collect_next_edges(mid));
        auto out = torch::zeros({2}, torch::kDouble);
        torch::autograd::set_history(out, to_meta);
        return TensorList{out};
      });
  auto [outputs, state] = forward(leaf, {randn({2})}, {0});
  auto g = replay(
      leaf, state, {torch::ones({2}, torch::kDouble)}, true, Path::Engine);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_TRUE(torch::allclose(g[0], torch::ones({2}, torch::kDouble)));
}

namespace {

// What a traced call's LeafBackward does, for an enclosing backward: replay
// the handle's graph from inside the outer graph task, recording its id.
std::atomic<int> g_outer_task{-2};

struct Replayer : public torch::autograd::Function<Replayer> {
  // `x` is the captured input, `out` the leaf's output for it.
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& out,
      int64_t leaf,
      const at::Tensor& state) {
    ctx->saved_data["leaf"] = leaf;
    ctx->saved_data["state"] = state;
    return out.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchleaf::backward", "")
                         .typed<BackwardSig>();
    g_outer_task = torchleaf::torch_private::current_graph_task_id();
    c10::List<std::optional<at::Tensor>> g(
        {std::optional<at::Tensor>(grads[0])});
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto in = op.call(
        ctx->saved_data["leaf"].toInt(),
        ctx->saved_data["state"].toTensor(),
        g,
        {});
    return {in[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

} // namespace

TEST(Replay, AnEnclosingBackwardRestrictedToSomeInputsGoesToTheEngine) {
  InlineReplayGuard restore;
  torchleaf::Config::set_inline_replay(true);
  auto leaf = torchleaf::define_leaf(
      unique_name("outer"),
      [](const TensorList& in) { return TensorList{probe(in[0]).sin()}; });
  auto x = randn({3}).requires_grad_(true);
  auto w = randn({3}).requires_grad_(true);
  auto [outputs, state] = forward(leaf, {x}, {0});
  auto y = Replayer::apply(x, outputs[0], leaf.id(), state);
  auto loss = (y * w).sum();
  const auto expected = w.detach() * x.detach().cos();

  // Unrestricted: the replay runs inline, inside the outer graph task.
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(torch::allclose(x.grad(), expected));
  EXPECT_NE(g_outer_task, -1);
  if (kInlineSupported) {
    EXPECT_EQ(g_probe_task, g_outer_task.load());
  }
  // Restricted to x: the outer task's exec_info would hide the captured
  // graph's nodes, so the replay gets a graph task of its own.
  auto gx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true);
  EXPECT_TRUE(torch::allclose(gx[0], expected));
  EXPECT_NE(g_probe_task, g_outer_task.load());
  EXPECT_NE(g_probe_task, -1);
}

TEST(Replay, TheSwitchIsReadPerCall) {
  InlineReplayGuard restore;
  torchleaf::Config::set_inline_replay(false);
  EXPECT_FALSE(torchleaf::Config::inline_replay());
  torchleaf::Config::set_inline_replay(true);
  EXPECT_EQ(torchleaf::Config::inline_replay(), kInlineSupported);
}

TEST(Replay, GradientsNeverShareStorageWithEachOtherOrTheIncomingGradients) {
  // AddBackward hands one tensor to both inputs and CloneBackward passes the
  // incoming gradient through: a compiled backward graph owns the outputs
  // of torchleaf::backward and Inductor reuses their buffers in place, so
  // each must be a tensor of its own.
  // (in[3], broadcast, gets a reduction of the incoming gradient: a view of
  // a temporary, its own.)
  auto leaf =
      torchleaf::define_leaf(unique_name("alias"), [](const TensorList& in) {
        auto s = probe(in[0] + in[1]);
        return TensorList{s, in[2].clone() + in[3]};
      });
  auto [outputs, state] = forward(
      leaf, {randn({3}), randn({3}), randn({2, 3}), randn({3})}, {0, 1, 2, 3});
  for (bool inline_replay : {true, false}) {
    SCOPED_TRACE(inline_replay);
    auto g0 = randn({3});
    auto g1 = randn({2, 3});
    auto g = replay(
        leaf,
        state,
        {g0, g1},
        inline_replay,
        inline_replay && kInlineSupported ? Path::Inline : Path::Engine);
    ASSERT_EQ(g.size(), 4u);
    EXPECT_TRUE(torch::equal(g[0], g0));
    EXPECT_TRUE(torch::equal(g[1], g0));
    EXPECT_TRUE(torch::equal(g[2], g1));
    EXPECT_TRUE(torch::allclose(g[3], g1.sum(0)));
    for (size_t i = 0; i < g.size(); ++i) {
      EXPECT_FALSE(g[i].is_alias_of(g0) || g[i].is_alias_of(g1))
          << "gradient " << i;
      for (size_t j = 0; j < i; ++j) {
        EXPECT_FALSE(g[i].is_alias_of(g[j]))
            << "gradients " << j << " and " << i;
      }
    }
  }
}

TEST(Replay, OnlyPyTorchFormulasAndTorchleafNodesCountAsPythonFree) {
  // The inline replay leaves PyTorch's stashed Python context in place for
  // graphs of such nodes only (capture.cpp, PythonContextSetAside): a rename
  // of PyTorch's namespace for its derivative formulas must fail here, not
  // slow every replay down unnoticed.
  auto x = randn({3}).requires_grad_();
  auto y = randn({3}).requires_grad_();
  for (const auto& t :
       {x * 2, x + y, (x * y).sin(), x.view({3, 1}), x.expand({2, 3}).sum(0)}) {
    EXPECT_TRUE(torchleaf::runs_without_python(*t.grad_fn()))
        << t.grad_fn()->name();
  }
  // A leaf whose output does not reach every input: its output's node is
  // torchleaf's own (attach_to_caller's routing node).
  auto leaf = torchleaf::define_leaf(
      unique_name("routing"),
      [](const TensorList& in) { return TensorList{in[0] * 2}; });
  auto out = leaf({x, y});
  ASSERT_TRUE(out[0].grad_fn() != nullptr);
  EXPECT_NE(out[0].grad_fn()->name().find("routing"), std::string::npos)
      << out[0].grad_fn()->name();
  EXPECT_TRUE(torchleaf::runs_without_python(*out[0].grad_fn()))
      << out[0].grad_fn()->name();
  // Anything else may run Python: a custom autograd::Function's node (here
  // C++, in general an extension's or PyTorch's Python autograd.Function).
  EXPECT_FALSE(torchleaf::runs_without_python(*probe(x).grad_fn()));
}

TEST(Replay, ViewsOfTemporariesNeedNoCopy) {
  // torch_private::is_view_of_unheld_base: the weight gradient of a matrix
  // product is a transposed view whose base (the product) only the view
  // holds, and at::sum_to's broadcast reduction a view of its sum; their
  // data is theirs alone. A view of a tensor something else holds, or two
  // views of one base, are shared.
  at::AutoGradMode no_grad(false); // (as replays run nodes)
  using torchleaf::torch_private::is_view_of_unheld_base;
  auto temporary = [] { return randn({3, 2}).mm(randn({2, 4})); };
  auto transposed_temporary = [&] { return temporary().t(); };
  EXPECT_TRUE(is_view_of_unheld_base(transposed_temporary()));
  EXPECT_TRUE(
      is_view_of_unheld_base(at::sum_to(randn({5, 3}), at::IntArrayRef{3})));
  auto held = temporary();
  EXPECT_FALSE(is_view_of_unheld_base(held.t()));
  auto first = transposed_temporary();
  EXPECT_TRUE(is_view_of_unheld_base(first));
  auto second = first.narrow(0, 0, 2);
  EXPECT_FALSE(is_view_of_unheld_base(first));
  EXPECT_FALSE(is_view_of_unheld_base(second));
  EXPECT_FALSE(is_view_of_unheld_base(temporary()));
}
