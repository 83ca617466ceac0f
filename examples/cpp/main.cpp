// A C++ leaf function with data-dependent control flow, called with autograd
// from C++ only. Exits non-zero if its gradient differs from the plain body's.
#include <torch/torch.h>
#include <torchleaf/torchleaf.h>

#include <iostream>

using torchleaf::TensorList;

namespace {

// Clips rows whose norm exceeds a threshold that the caller can change at any
// time: exactly the kind of code a tracing compiler must not bake in.
double g_threshold = 1.0;

TensorList clip_rows(const TensorList& in) {
  auto norms = in[0].norm(2, 1, /*keepdim=*/true);
  if (norms.max().item<double>() <= g_threshold) {
    return {in[0] * 1};
  }
  return {in[0] * (g_threshold / norms).clamp_max(1.0)};
}

} // namespace

int main() {
  auto clip = torchleaf::define_leaf(
      "example::clip_rows", clip_rows, [](const TensorList& in) {
        return TensorList{at::empty_like(in[0])};
      });

  torch::manual_seed(0);
  auto x = (torch::randn({4, 3}) * 2).requires_grad_(true);
  auto out = clip({x})[0];
  auto grad = torch::autograd::grad({out.pow(2).sum()}, {x})[0];

  auto xr = x.detach().clone().requires_grad_(true);
  auto expected = torch::autograd::grad({clip_rows({xr})[0].pow(2).sum()}, {xr})[0];

  const bool ok = torch::allclose(grad, expected) && torchleaf::live_states() == 0;
  std::cout << "leaf " << clip.name() << ": gradient "
            << (ok ? "matches" : "DIFFERS FROM") << " the plain body" << std::endl;
  return ok ? 0 : 1;
}
