#include "leaves.h"

#include <ATen/ATen.h>

using torchleaf::TensorList;

namespace {

TensorList clip_rows_impl(const TensorList& in) {
  auto norms = in[0].norm(2, 1, /*keepdim=*/true);
  if (norms.max().item<double>() <= 1.0) {
    return {in[0] * 1, norms};
  }
  return {in[0] * (1.0 / norms).clamp_max(1.0), norms};
}

TensorList clip_rows_fake(const TensorList& in) {
  return {at::empty_like(in[0]), at::empty_symint({in[0].sym_size(0), 1}, in[0].options())};
}

const torchleaf::LeafFunction g_clip_rows = torchleaf::define_leaf(
    "aoti_example::clip_rows", clip_rows_impl, clip_rows_fake, torchleaf::LeafOptions().inputs(1));

} // namespace

namespace aoti_example {

torchleaf::LeafFunction clip_rows() {
  return g_clip_rows;
}

} // namespace aoti_example
