// Defining and calling C++ leaf functions: values, the dispatcher path, fake
// implementations and declared mutation.
#include "test_util.h"

#include "csrc/torch_private.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <algorithm>

using torchleaf::TensorList;

TEST(Leaf, EagerCallMatchesBodyAndRunsOnce) {
  int real_calls = 0;
  auto leaf = torchleaf::define_leaf(
      unique_name("affine"),
      [&](const TensorList& in) {
        ++real_calls;
        // Data-dependent control flow is fine in a real implementation.
        if (in[0].sum().item<double>() > 0) {
          return TensorList{in[0] * 2 + in[1]};
        }
        return TensorList{in[0] - in[1]};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  auto x = torch::rand({5}) + 0.1;
  auto y = torch::randn({5});
  auto out = leaf({x, y});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(torch::allclose(out[0], x * 2 + y));
  EXPECT_EQ(real_calls, 1);
  out = leaf({-x, y});
  EXPECT_TRUE(torch::allclose(out[0], -x - y));
  EXPECT_EQ(real_calls, 2);
}

// A kernel reached from a TorchDispatchMode's handler runs with the
// conjugate and negative fallbacks excluded; the body must not: z.conj()
// is a lazy view, and `* i` must read it conjugated.
TEST(Leaf, BodyRunsWithTheConjugateFallbackWhereverTheCallComesFrom) {
  auto leaf = torchleaf::define_leaf(
      unique_name("conj"),
      [](const TensorList& in) {
        auto z = at::complex(in[0], in[0].flip(0));
        return TensorList{at::real(z.conj() * c10::complex<double>(0, 1))};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  auto x = torch::tensor({1.0, 2.0}, torch::kFloat64);
  const auto expected = torch::tensor({2.0, 1.0}, torch::kFloat64);
  EXPECT_TRUE(torch::equal(leaf({x})[0], expected));
  {
    torchleaf::torch_private::ExcludeDispatchKeyGuard handler(
        c10::DispatchKeySet(
            {c10::DispatchKey::Conjugate,
             c10::DispatchKey::Negative,
             c10::DispatchKey::ZeroTensor}));
    EXPECT_TRUE(torch::equal(leaf({x})[0], expected));
    EXPECT_TRUE(torch::equal(leaf({x.requires_grad_()})[0], expected));
  }
}

TEST(Leaf, IsANamedOperator) {
  const auto name = unique_name("named");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{in[0] + 1}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  ASSERT_TRUE(op.has_value());
  EXPECT_EQ(leaf.name(), name);
  // Called through the dispatcher directly, by name.
  auto out = op->typed<TensorList(at::TensorList)>().call({torch::ones({2})});
  EXPECT_TRUE(torch::allclose(out[0], torch::full({2}, 2.0)));
  ASSERT_TRUE(torchleaf::find_leaf(name).has_value());
  EXPECT_EQ(torchleaf::find_leaf(name)->id(), leaf.id());
  EXPECT_FALSE(torchleaf::find_leaf("cpptest::never_defined").has_value());
}

TEST(Leaf, MetaTensorsRunTheFakeNeverTheReal) {
  int real_calls = 0, fake_calls = 0;
  auto leaf = torchleaf::define_leaf(
      unique_name("meta"),
      [&](const TensorList& in) {
        ++real_calls;
        return TensorList{in[0].sum(0)};
      },
      [&](const TensorList& in) {
        ++fake_calls;
        return TensorList{at::empty({in[0].size(1)}, in[0].options())};
      });
  auto x = torch::empty({3, 4}, torch::device(torch::kMeta));
  auto out = leaf({x});
  EXPECT_TRUE(out[0].is_meta());
  EXPECT_EQ(out[0].sizes(), c10::IntArrayRef({4}));
  EXPECT_EQ(real_calls, 0);
  EXPECT_EQ(fake_calls, 1);
  // Also with inputs that require grad (through torchleaf::forward's Meta
  // kernel).
  auto xr =
      torch::empty({3, 4}, torch::device(torch::kMeta).requires_grad(true));
  out = leaf({xr});
  EXPECT_TRUE(out[0].requires_grad());
  EXPECT_EQ(real_calls, 0);
  EXPECT_EQ(fake_calls, 2);
}

// A fake that returns one tensor twice, or an input: the traced outputs
// must be the operator's own, as the real ones are.
TEST(Leaf, FakeOutputsNeverAliasInputsOrEachOther) {
  auto leaf = torchleaf::define_leaf(
      unique_name("aliasing_fake"),
      [](const TensorList& in) {
        return TensorList{in[0].sin(), in[0].cos(), in[0].exp()};
      },
      [](const TensorList& in) {
        auto t = at::empty_like(in[0]);
        return TensorList{t, t, in[0]};
      });
  auto x = torch::empty({3}, torch::device(torch::kMeta));
  auto out = leaf({x});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_FALSE(out[1].is_alias_of(out[0]));
  EXPECT_FALSE(out[2].is_alias_of(x));
}

TEST(Leaf, MissingFakeIsAClearErrorOnlyWhenNeeded) {
  const auto name = unique_name("nofake");
  auto leaf = torchleaf::define_leaf(
      name, [](const TensorList& in) { return TensorList{in[0] * 3}; });
  EXPECT_TRUE(
      torch::allclose(leaf({torch::ones({2})})[0], torch::full({2}, 3.0)));
  EXPECT_THROW_WITH(
      leaf({torch::empty({2}, torch::device(torch::kMeta))}),
      "'" + name + "' requires a fake implementation");
}

TEST(Leaf, DeclaredMutationIsVisibleUndeclaredIsAnError) {
  auto counter = torchleaf::define_leaf(
      unique_name("count"),
      [](const TensorList& in) {
        in[1].add_(1); // declared below
        return TensorList{in[0] * 2};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().mutates({1}));
  auto buf = torch::zeros({1});
  auto x = torch::ones({3});
  auto out = counter({x, buf});
  EXPECT_TRUE(torch::allclose(out[0], x * 2));
  EXPECT_EQ(buf.item<float>(), 1.0f);
  counter({x, buf});
  EXPECT_EQ(buf.item<float>(), 2.0f);

  const auto name = unique_name("sneaky");
  auto sneaky = torchleaf::define_leaf(
      name,
      [](const TensorList& in) {
        in[0].mul_(2);
        return TensorList{in[0] + 1};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  EXPECT_THROW_WITH(sneaky({torch::ones({2})}), "mutated its input 0");

  // Inference mode keeps normal tensors' version counters: the body's
  // in-place changes count there too (y is not an inference tensor).
  const auto y = torch::ones({2});
  const c10::InferenceMode inference;
  EXPECT_THROW_WITH(sneaky({y}), "mutated its input 0");
  const auto version = buf._version();
  counter({x, buf});
  EXPECT_EQ(buf._version(), version + 1);
}

TEST(Leaf, AnInPlaceChangeThatWouldCarryAGradientIsAnError) {
  // buf += 3 * x: the caller's buf gets the new data but not its history (a
  // leaf's backward is its outputs'), so x's gradient through buf would be
  // lost silently; the call says so instead.
  auto body = [](const TensorList& in) {
    in[1].add_(in[0] * 3);
    return TensorList{in[0] * 2};
  };
  auto fake = [](const TensorList& in) {
    return TensorList{at::empty_like(in[0])};
  };
  const auto name = unique_name("accumulates");
  auto accumulates = torchleaf::define_leaf(
      name, body, fake, torchleaf::LeafOptions().mutates({1}));
  auto buf = torch::zeros({2});
  const auto x = torch::ones({2}, torch::requires_grad());
  EXPECT_THROW_WITH(
      accumulates({x, buf}),
      "changed its declared-mutable tensor 0 (counting from 0: the tensor arguments");
  EXPECT_THROW_WITH(accumulates({x, buf}), name);
  // Nothing that requires grad: the change is plain data.
  buf.zero_();
  accumulates({x.detach(), buf});
  EXPECT_TRUE(torch::allclose(buf, torch::full({2}, 3.0)));
  // Dropped knowingly: the data changes, no history.
  auto dropping = torchleaf::define_leaf(
      unique_name("drops"),
      body,
      fake,
      torchleaf::LeafOptions().mutates({1}).check_escaped(false));
  auto out = dropping({x, buf});
  EXPECT_TRUE(torch::allclose(buf, torch::full({2}, 6.0)));
  EXPECT_FALSE(buf.requires_grad());
  out[0].sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), torch::full({2}, 2.0)));
  EXPECT_EQ(torchleaf::live_states(), 0);
}

TEST(Leaf, OutputValidationNamesTheDifference) {
  const auto name = unique_name("validated");
  auto leaf = torchleaf::define_leaf(
      name,
      [](const TensorList& in) { return TensorList{in[0].sum(0)}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().validate(true));
  EXPECT_THROW_WITH(
      leaf({torch::ones({2, 3})}),
      "has shape [3] but its fake implementation gives shape [2, 3]");

  auto dtype_leaf = torchleaf::define_leaf(
      unique_name("dtype"),
      [](const TensorList& in) { return TensorList{in[0].to(torch::kDouble)}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().validate(true));
  EXPECT_THROW_WITH(
      dtype_leaf({torch::ones({2})}),
      "has dtype Double but its fake implementation gives dtype Float");

  auto count_leaf = torchleaf::define_leaf(
      unique_name("count"),
      [](const TensorList& in) {
        return TensorList{in[0] + 1, in[0] - 1};
      },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
      torchleaf::LeafOptions().validate(true));
  EXPECT_THROW_WITH(
      count_leaf({torch::ones({2})}),
      "returned 2 tensor(s) but its fake implementation returned 1");

  // Validation off (the default): the mismatch is not looked for.
  auto lax = torchleaf::define_leaf(
      unique_name("lax"),
      [](const TensorList& in) { return TensorList{in[0].sum(0)}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  EXPECT_EQ(lax({torch::ones({2, 3})})[0].dim(), 1);
  // The global switch turns it on for leaves without their own setting.
  torchleaf::Config::set_validate_outputs(true);
  EXPECT_THROW_WITH(lax({torch::ones({2, 3})}), "has shape [3]");
  torchleaf::Config::set_validate_outputs(false);
}

TEST(Leaf, OutputsNeverAliasInputs) {
  auto identity = torchleaf::define_leaf(
      unique_name("identity"),
      [](const TensorList& in) {
        return TensorList{in[0], in[0].view({-1})};
      },
      [](const TensorList& in) {
        return TensorList{
            at::empty_like(in[0]), at::empty({in[0].numel()}, in[0].options())};
      });
  auto x = torch::ones({2, 2});
  auto out = identity({x});
  EXPECT_FALSE(out[0].is_alias_of(x));
  EXPECT_FALSE(out[1].is_alias_of(x));
  EXPECT_TRUE(torch::equal(out[0], x));
}

namespace {
std::vector<std::string>* g_profiled_names = nullptr;
} // namespace

TEST(Leaf, ProfilersSeeTheLeafsOperatorAndItsRealFunction) {
  // The named operator's range is the dispatcher's; the real function's is
  // torchleaf's own (ProfilerRange), recorded only while a profiler listens.
  std::vector<std::string> names;
  g_profiled_names = &names;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        g_profiled_names->emplace_back(fn.name());
        return nullptr;
      }));
  const auto name = unique_name("profiled");
  auto leaf = torchleaf::define_leaf(
      name, [](const TensorList& in) { return TensorList{in[0] + 1}; });
  auto x = torch::randn({3}, torch::requires_grad());
  leaf({x})[0].sum().backward();
  at::removeCallback(handle);
  g_profiled_names = nullptr;
  std::string seen;
  for (const auto& n : names) {
    seen += n + " ";
  }
  EXPECT_EQ(std::count(names.begin(), names.end(), name), 2) << seen;
  const auto recorded = names.size();
  EXPECT_TRUE(torch::allclose(leaf({x})[0], x + 1));
  EXPECT_EQ(names.size(), recorded); // no listener, nothing recorded
}
