// Per-call cost of a C++ leaf function against the same small body written
// inline (the floor) and as a hand-written torch::autograd::Function.
//
// Body: y = x * 2 + 1 on a 64-element float32 tensor, so that per-call
// overhead dominates. "Fwd" runs the forward with x requiring grad (the
// autograd graph is recorded); "FwdBwd" also runs backward of y.sum().
// The leaf's live-state count is reported as a counter, so a leak shows.

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <torchleaf/config.h>
#include <torchleaf/leaf.h>

namespace {

using torchleaf::TensorList;

at::Tensor body(const at::Tensor& x) {
  return x * 2 + 1;
}

// The hand-written reference: same body, backward written by hand.
struct MulAddFunction : public torch::autograd::Function<MulAddFunction> {
  static at::Tensor forward(
      torch::autograd::AutogradContext* /*ctx*/,
      const at::Tensor& x) {
    return body(x);
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* /*ctx*/,
      torch::autograd::variable_list grads) {
    return {grads[0] * 2};
  }
};

const torchleaf::LeafFunction& leaf() {
  static const torchleaf::LeafFunction f = torchleaf::define_leaf(
      "torchleaf_bench::mul_add",
      [](const TensorList& in) { return TensorList{body(in[0])}; },
      [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });
  return f;
}

at::Tensor make_input() {
  return torch::randn({64}, torch::kFloat32).requires_grad_(true);
}

template <typename Call>
void run_forward(benchmark::State& state, Call call) {
  at::Tensor x = make_input();
  for (auto _ : state) {
    at::Tensor y = call(x);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.counters["live_states"] = static_cast<double>(torchleaf::live_states());
}

template <typename Call>
void run_forward_backward(benchmark::State& state, Call call) {
  at::Tensor x = make_input();
  for (auto _ : state) {
    call(x).sum().backward();
    x.mutable_grad().reset(); // same work for every variant: no accumulation
  }
  state.counters["live_states"] = static_cast<double>(torchleaf::live_states());
}

at::Tensor call_plain(const at::Tensor& x) {
  return body(x);
}
at::Tensor call_function(const at::Tensor& x) {
  return MulAddFunction::apply(x);
}
at::Tensor call_leaf(const at::Tensor& x) {
  return leaf()({x})[0];
}

void BM_Plain_Fwd(benchmark::State& s) { run_forward(s, call_plain); }
void BM_Function_Fwd(benchmark::State& s) { run_forward(s, call_function); }
void BM_Leaf_Fwd(benchmark::State& s) { run_forward(s, call_leaf); }
void BM_Plain_FwdBwd(benchmark::State& s) { run_forward_backward(s, call_plain); }
void BM_Function_FwdBwd(benchmark::State& s) { run_forward_backward(s, call_function); }
void BM_Leaf_FwdBwd(benchmark::State& s) { run_forward_backward(s, call_leaf); }
// The leaf with every replay through torch::autograd::Engine: what the
// inline replay saves where it is compiled in (PyTorch 2.13, capture.h), and
// the same as BM_Leaf_FwdBwd built against any other release.
void BM_Leaf_FwdBwd_EngineReplay(benchmark::State& s) {
  const bool was = torchleaf::Config::inline_replay();
  torchleaf::Config::set_inline_replay(false);
  run_forward_backward(s, call_leaf);
  torchleaf::Config::set_inline_replay(was);
}

BENCHMARK(BM_Plain_Fwd);
BENCHMARK(BM_Function_Fwd);
BENCHMARK(BM_Leaf_Fwd);
BENCHMARK(BM_Plain_FwdBwd);
BENCHMARK(BM_Function_FwdBwd);
BENCHMARK(BM_Leaf_FwdBwd);
BENCHMARK(BM_Leaf_FwdBwd_EngineReplay);

} // namespace

int main(int argc, char** argv) {
  leaf(); // define the operator before timing
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
