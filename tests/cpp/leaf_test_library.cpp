// A library of C++ leaf functions, loaded by the Python tests
// (torchleaf.load_library) to check that C++ leaves compile, export and
// train from Python.
#include <ATen/ATen.h>
#include <torchleaf/torchleaf.h>

using torchleaf::TensorList;

namespace {

// y = x * scale + bias, where `scale` is process state read on every call.
double g_scale = 2.0;

const auto scale_bias = torchleaf::define_leaf(
    "torchleaf_test::scale_bias",
    [](const TensorList& in) { return TensorList{in[0] * g_scale + in[1]}; },
    [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; });

// Data-dependent output size: the positive entries of x, doubled.
const auto positives = torchleaf::define_leaf(
    "torchleaf_test::positives",
    [](const TensorList& in) {
      return TensorList{in[0].masked_select(in[0] > 0) * 2};
    },
    [](const TensorList& in) {
      // nonzero() allocates an unbacked size under fake tensors.
      auto n = in[0].flatten().nonzero().sym_size(0);
      return TensorList{at::empty_symint({n}, in[0].options())};
    });

// Counts calls into a buffer it declares as mutated.
const auto count_calls = torchleaf::define_leaf(
    "torchleaf_test::count_calls",
    [](const TensorList& in) {
      in[1].add_(1);
      return TensorList{in[0].sin()};
    },
    [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
    torchleaf::LeafOptions().mutates({1}));

// Declares its arity: calls with another number of tensors are a clear
// error instead of an out-of-bounds read of `in`.
const auto checked_add = torchleaf::define_leaf(
    "torchleaf_test::checked_add",
    [](const TensorList& in) { return TensorList{in[0] + in[1]}; },
    [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
    torchleaf::LeafOptions().inputs(2));

// f(x) = (x * 3).sin(), for forward-mode AD tests.
const auto sin3 = torchleaf::define_leaf(
    "torchleaf_test::sin3",
    [](const TensorList& in) { return TensorList{(in[0] * 3).sin()}; },
    [](const TensorList& in) { return TensorList{at::empty_like(in[0])}; },
    torchleaf::LeafOptions().inputs(1));

} // namespace

extern "C" void torchleaf_test_set_scale(double scale) {
  g_scale = scale;
}
