// A leaf operator call's inputs: merged into the leaf's flat order, checked
// for forward-mode tangents, and the differentiable inputs' metadata that
// torchleaf::backward's fake kernel decodes.

#include <ATen/ATen.h>

#include <limits>

#include <torchleaf/errors.h>

#include "../torch_private.h"
#include "kernels.h"
#include "leaf_ops.h"

namespace torchleaf::ops {

// Whether `t` carries a forward-mode AD tangent. Eager forward AD has one
// level, 0 (nesting is refused); torch.func.jvp nests through functorch
// levels instead, each with its own wrapper tensors whose tangents are also
// at level 0. _fw_grad honours the thread's forward-grad mode and finds a
// view's tangent through its base; it takes a lock, which inputs with no
// tangent and no view skip.
bool has_forward_tangent(const at::Tensor& t) {
  if (!t.defined()) {
    return false;
  }
  if (!torch_private::may_have_forward_grad(t)) {
    return false;
  }
  return t._fw_grad(/*level=*/0).defined();
}

void check_no_forward_tangents(
    const std::string& leaf_name,
    at::TensorList inputs,
    at::TensorList mutated) {
  for (size_t i = 0; i < inputs.size() + mutated.size(); ++i) {
    const auto& t = i < inputs.size() ? inputs[i] : mutated[i - inputs.size()];
    TORCHLEAF_CHECK(
        !has_forward_tangent(t),
        leaf_name,
        "received a forward-mode AD tangent at input ",
        i,
        ", but forward-mode AD (jvp, make_dual) is not supported through leaf "
        "function '",
        leaf_name,
        "'; the tangent would be silently lost. Use reverse-mode AD through "
        "the leaf (torch.autograd.grad or .backward(); in eager mode a jvp is "
        "the gradient of a vjp with respect to its cotangent, with "
        "create_graph=True), or compute the jvp of the undecorated function.");
  }
}

void check_no_forward_tangents(
    int64_t leaf,
    at::TensorList inputs,
    at::TensorList mutated) {
  for (const auto* list : {&inputs, &mutated}) {
    for (const auto& t : *list) {
      if (has_forward_tangent(t)) {
        check_no_forward_tangents(get_leaf(leaf)->name, inputs, mutated);
      }
    }
  }
}

FlatInputs merge_inputs(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated) {
  FlatInputs flat;
  const size_t total = inputs.size() + mutated.size();
  // Every kernel of every leaf operator (real, fake, forward, eager) merges
  // its inputs here, so the declared arity is checked on every path.
  entry.check_input_count(total);
  // Also here, not only in the Autograd kernel: under nested functorch
  // transforms (jvp of grad) the tangents sit on tensors that only the
  // kernels below Autograd see.
  check_no_forward_tangents(entry.name, inputs, mutated);
  flat.tensors.reserve(total);
  flat.input_positions.reserve(inputs.size());
  const auto& declared = entry.options.mutates_inputs;
  if (declared.empty()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      flat.input_positions.push_back(i);
      flat.tensors.push_back(inputs[i]);
    }
    flat.tensors.insert(flat.tensors.end(), mutated.begin(), mutated.end());
    if (!mutated.empty()) {
      flat.is_mutable.assign(total, false);
      std::fill(
          flat.is_mutable.begin() + inputs.size(), flat.is_mutable.end(), true);
    }
    return flat;
  }
  TORCHLEAF_CHECK(
      mutated.size() == declared.size(),
      entry.name,
      "declares ",
      declared.size(),
      " mutable input(s) but received ",
      mutated.size(),
      " in the mutated list.");
  // `declared` is sorted and free of duplicates (define_leaf), so once its
  // largest position is in range, exactly inputs.size() positions are plain.
  TORCHLEAF_CHECK(
      static_cast<size_t>(declared.back()) < total,
      entry.name,
      "declares mutable input position ",
      declared.back(),
      " but was called with ",
      total,
      " input tensor(s), mutable ones included. Pass every input, or declare "
      "the leaf's arity with LeafOptions::inputs to get this error with the "
      "expected count.");
  size_t next_input = 0;
  size_t next_mutated = 0;
  flat.is_mutable.assign(total, false);
  for (size_t pos = 0; pos < total; ++pos) {
    if (entry.mutates(pos)) {
      TORCH_INTERNAL_ASSERT(next_mutated < mutated.size());
      flat.is_mutable[pos] = true;
      flat.tensors.push_back(mutated[next_mutated++]);
    } else {
      TORCH_INTERNAL_ASSERT(next_input < inputs.size());
      flat.input_positions.push_back(pos);
      flat.tensors.push_back(inputs[next_input++]);
    }
  }
  return flat;
}

void append_input_meta(std::vector<c10::SymInt>& meta, const at::Tensor& t) {
  meta.emplace_back(static_cast<int64_t>(t.scalar_type()));
  meta.emplace_back(static_cast<int64_t>(t.device().type()));
  meta.emplace_back(static_cast<int64_t>(t.device().index()));
  auto sizes = t.sym_sizes();
  meta.emplace_back(static_cast<int64_t>(sizes.size()));
  meta.insert(meta.end(), sizes.begin(), sizes.end());
}

std::vector<DecodedInputMeta> decode_input_meta(
    const std::string& leaf_name,
    c10::SymIntArrayRef meta) {
  // Reachable with arbitrary values from C++ callers of torchleaf::backward:
  // every read is bounds-checked.
  auto fail = [&](size_t at, const std::string& what) {
    detail::throw_leaf_error(
        leaf_name,
        c10::str(
            "backward received malformed input_meta (",
            meta.size(),
            " entries; at entry ",
            at,
            ": ",
            what,
            "). input_meta must hold [dtype, device type, device index, ndim, "
            "sizes...] per differentiable input, as torchleaf::forward's "
            "Autograd kernel records it; pass it through unchanged."));
  };
  auto int_at = [&](size_t i) -> int64_t {
    auto v = meta[i].maybe_as_int();
    if (!v) {
      fail(i, "a symbolic value where an integer is required");
    }
    return *v;
  };
  std::vector<DecodedInputMeta> out;
  size_t i = 0;
  while (i < meta.size()) {
    if (meta.size() - i < 4) {
      fail(i, "a record shorter than its 4-entry header");
    }
    const int64_t dtype = int_at(i);
    if (dtype < 0 ||
        dtype >= static_cast<int64_t>(at::ScalarType::NumOptions)) {
      fail(i, c10::str("unknown dtype code ", dtype));
    }
    const int64_t device_type = int_at(i + 1);
    if (device_type < 0 ||
        device_type >= static_cast<int64_t>(
                           c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)) {
      fail(i + 1, c10::str("unknown device type code ", device_type));
    }
    const int64_t device_index = int_at(i + 2);
    if (device_index < -1 ||
        device_index > std::numeric_limits<c10::DeviceIndex>::max()) {
      fail(i + 2, c10::str("device index ", device_index, " out of range"));
    }
    const int64_t ndim = int_at(i + 3);
    if (ndim < 0 || static_cast<size_t>(ndim) > meta.size() - i - 4) {
      fail(
          i + 3,
          c10::str("ndim ", ndim, " does not fit the remaining entries"));
    }
    DecodedInputMeta decoded{
        static_cast<at::ScalarType>(dtype),
        c10::Device(
            static_cast<c10::DeviceType>(device_type),
            static_cast<c10::DeviceIndex>(device_index)),
        std::vector<c10::SymInt>(
            meta.begin() + i + 4, meta.begin() + i + 4 + ndim)};
    for (size_t d = 0; d < decoded.sizes.size(); ++d) {
      if (auto v = decoded.sizes[d].maybe_as_int(); v && *v < 0) {
        fail(i + 4 + d, c10::str("negative size ", *v));
      }
    }
    out.push_back(std::move(decoded));
    i += 4 + ndim;
  }
  return out;
}

} // namespace torchleaf::ops
