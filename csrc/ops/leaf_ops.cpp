#include "leaf_ops.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <torchleaf/errors.h>

#include <limits>

#include "../capture.h"
#include "../profiler_range.h"
#include "../state.h"

namespace torchleaf::ops {

TensorList call(int64_t leaf, int64_t plan, at::TensorList inputs, at::TensorList mutated) {
  if (mutated.empty()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchleaf::call", "")
                         .typed<TensorList(int64_t, int64_t, at::TensorList)>();
    return op.call(leaf, plan, inputs);
  }
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchleaf::call_mutating", "")
          .typed<TensorList(int64_t, int64_t, at::TensorList, at::TensorList)>();
  return op.call(leaf, plan, inputs, mutated);
}

std::tuple<TensorList, at::Tensor> forward(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  using Result = std::tuple<TensorList, at::Tensor>;
  if (mutated.empty()) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torchleaf::forward", "")
            .typed<Result(int64_t, int64_t, at::TensorList, at::IntArrayRef)>();
    return op.call(leaf, plan, inputs, differentiable);
  }
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchleaf::forward_mutating", "")
          .typed<Result(int64_t, int64_t, at::TensorList, at::TensorList, at::IntArrayRef)>();
  return op.call(leaf, plan, inputs, mutated, differentiable);
}

TensorList backward(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::backward", "")
                       .typed<TensorList(
                           int64_t,
                           const at::Tensor&,
                           const c10::List<std::optional<at::Tensor>>&,
                           c10::SymIntArrayRef)>();
  return op.call(leaf, state, grads, input_meta);
}

namespace {

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
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  if (meta == nullptr || (!meta->fw_grad_ && !meta->is_view_)) {
    return false;
  }
  return t._fw_grad(/*level=*/0).defined();
}

} // namespace

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

void check_no_forward_tangents(int64_t leaf, at::TensorList inputs, at::TensorList mutated) {
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
      std::fill(flat.is_mutable.begin() + inputs.size(), flat.is_mutable.end(), true);
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
    if (dtype < 0 || dtype >= static_cast<int64_t>(at::ScalarType::NumOptions)) {
      fail(i, c10::str("unknown dtype code ", dtype));
    }
    const int64_t device_type = int_at(i + 1);
    if (device_type < 0 ||
        device_type >= static_cast<int64_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)) {
      fail(i + 1, c10::str("unknown device type code ", device_type));
    }
    const int64_t device_index = int_at(i + 2);
    if (device_index < -1 || device_index > std::numeric_limits<c10::DeviceIndex>::max()) {
      fail(i + 2, c10::str("device index ", device_index, " out of range"));
    }
    const int64_t ndim = int_at(i + 3);
    if (ndim < 0 || static_cast<size_t>(ndim) > meta.size() - i - 4) {
      fail(i + 3, c10::str("ndim ", ndim, " does not fit the remaining entries"));
    }
    DecodedInputMeta decoded{
        static_cast<at::ScalarType>(dtype),
        c10::Device(
            static_cast<c10::DeviceType>(device_type),
            static_cast<c10::DeviceIndex>(device_index)),
        std::vector<c10::SymInt>(meta.begin() + i + 4, meta.begin() + i + 4 + ndim)};
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

TensorList call_real(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site) {
  auto flat = merge_inputs(entry, inputs, mutated);
  return run_real(entry, flat.tensors, flat.is_mutable, site);
}

TensorList call_fake(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site,
    bool strides_relied_on) {
  auto flat = merge_inputs(entry, inputs, mutated);
  auto outputs = run_fake(entry, flat.tensors, site);
  copy_aliased_outputs(outputs, flat.tensors);
  // Every fake kernel comes here when a graph is traced: what the graph will
  // assume about this call's outputs, checked on every real call (run_real).
  entry.fake_outputs.record(site.plan, flat.tensors, outputs, strides_relied_on);
  return outputs;
}

namespace {

InputFlags capture_mask(
    const LeafEntry& entry,
    const FlatInputs& flat,
    at::IntArrayRef differentiable) {
  InputFlags mask(flat.tensors.size(), false);
  for (int64_t i : differentiable) {
    TORCHLEAF_CHECK(
        i >= 0 && static_cast<size_t>(i) < flat.input_positions.size(),
        entry.name,
        "differentiable input index ",
        i,
        " is out of range for ",
        flat.input_positions.size(),
        " inputs.");
    mask[flat.input_positions[i]] = true;
  }
  return mask;
}

TensorList call_mutating_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  CallSite site{plan};
  return call_real(*get_leaf(leaf), inputs, mutated, site);
}

TensorList call_kernel(int64_t leaf, int64_t plan, at::TensorList inputs) {
  return call_mutating_kernel(leaf, plan, inputs, {});
}

TensorList call_mutating_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  CallSite site{plan};
  return call_fake(*get_leaf(leaf), inputs, mutated, site);
}

TensorList call_meta(int64_t leaf, int64_t plan, at::TensorList inputs) {
  return call_mutating_meta(leaf, plan, inputs, {});
}

std::tuple<TensorList, at::Tensor> run_forward(
    LeafEntryPtr entry,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  auto flat = merge_inputs(*entry, inputs, mutated);
  auto mask = capture_mask(*entry, flat, differentiable);
  std::shared_ptr<CapturedState> state;
  CallSite site{plan};
  TensorList outputs = run_real(*entry, flat.tensors, flat.is_mutable, site, mask, &state);
  if (state == nullptr) { // nothing differentiable: an empty graph
    state = std::make_shared<CapturedState>();
    state->entry = entry;
    state->output_edges.resize(outputs.size());
  }
  return {std::move(outputs), make_state_handle(std::move(state))};
}

std::tuple<TensorList, at::Tensor> forward_mutating_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  return run_forward(get_leaf(leaf), plan, inputs, mutated, differentiable);
}

std::tuple<TensorList, at::Tensor> forward_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable) {
  return forward_mutating_kernel(leaf, plan, inputs, {}, differentiable);
}

std::tuple<TensorList, at::Tensor> forward_mutating_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef /*differentiable*/) {
  return {call_mutating_meta(leaf, plan, inputs, mutated),
          at::empty({}, at::TensorOptions().dtype(at::kLong).device(at::kMeta))};
}

std::tuple<TensorList, at::Tensor> forward_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable) {
  return forward_mutating_meta(leaf, plan, inputs, {}, differentiable);
}

std::vector<std::optional<at::Tensor>> to_vector(
    const c10::List<std::optional<at::Tensor>>& grads) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(grads.size());
  for (const auto& g : grads) {
    out.push_back(g);
  }
  return out;
}

TensorList run_backward(
    const CapturedState& captured,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads) {
  auto grads_in = replay(captured, grads);
  release_after_backward(state);
  // The fake kernel knows only the inputs' sizes and promises contiguous
  // gradients (Inductor asserts the strides); a channels_last input's
  // gradient is channels_last.
  for (auto& g : grads_in) {
    if (!g.is_contiguous()) {
      g = g.contiguous();
    }
  }
  return grads_in;
}

TensorList backward_kernel(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef /*input_meta*/) {
  return run_backward(*lookup_state(state, leaf), state, to_vector(grads));
}

at::Tensor stack_handles_meta(at::TensorList handles) {
  TORCH_CHECK(!handles.empty(), "stack_handles: no handles");
  std::vector<c10::SymInt> sizes{c10::SymInt(static_cast<int64_t>(handles.size()))};
  const auto shape = handles[0].sym_sizes();
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  return at::empty_symint(sizes, handles[0].options().device(c10::kMeta));
}

TensorList backward_meta(
    int64_t leaf,
    const at::Tensor& /*state*/,
    const c10::List<std::optional<at::Tensor>>& /*grads*/,
    c10::SymIntArrayRef input_meta) {
  // The gradients' metadata is all in input_meta: a backward traced
  // lazily (Inductor compiles it at the first backward) needs no live leaf,
  // as its replay does not (the state keeps what it needs).
  auto entry = find_leaf(leaf);
  TensorList out;
  for (const auto& meta :
       decode_input_meta(entry ? entry->name : c10::str("<id ", leaf, ">"), input_meta)) {
    out.push_back(at::empty_symint(
        meta.sizes, at::TensorOptions().dtype(meta.dtype).device(at::kMeta)));
  }
  return out;
}

// The int a carrier's size codes (Python leaves' _int_of_carrier).
int64_t carried_value(int64_t size, bool zigzag) {
  return !zigzag ? size : size % 2 == 0 ? size / 2 : -(size + 1) / 2;
}

void check_carried_int_kernel(
    c10::string_view leaf,
    const at::Tensor& carrier,
    c10::SymInt expected,
    bool zigzag) {
  TORCHLEAF_CHECK(
      carrier.dim() == 1,
      std::string(leaf),
      "got a ",
      carrier.dim(),
      "-d int carrier; torchleaf::check_carried_int takes the 1-d carrier of an int "
      "output.");
  const int64_t size = carrier.size(0);
  const int64_t fake = expected.expect_int();
  TORCHLEAF_CHECK(
      size == fake,
      std::string(leaf),
      "returned the int ",
      carried_value(size, zigzag),
      " where its fake implementation returned ",
      carried_value(fake, zigzag),
      " (compiled code computes the fake's int from the inputs' sizes and uses it in "
      "place of the function's). Make the fake return the same expression of the "
      "inputs' sizes as the function, or an unbacked int "
      "(torch.library.get_ctx().new_dynamic_size()) when the int depends on the data.");
}

void check_carried_int_meta(
    c10::string_view /*leaf*/,
    const at::Tensor& /*carrier*/,
    c10::SymInt /*expected*/,
    bool /*zigzag*/) {}

void check_output_sizes_kernel(
    c10::string_view leaf,
    int64_t output,
    const at::Tensor& tensor,
    c10::SymIntArrayRef expected) {
  const auto fake = C10_AS_INTARRAYREF_SLOW(expected);
  TORCHLEAF_CHECK(
      tensor.sizes() == fake,
      std::string(leaf),
      "output ",
      output,
      " has shape ",
      tensor.sizes(),
      " but its fake implementation returned shape ",
      fake,
      " (compiled code computes the fake's sizes from the inputs' sizes and uses them in "
      "place of the output's). Fix the fake implementation so that its sizes are the "
      "function's expressions of the inputs' sizes (torch.library.get_ctx()."
      "new_dynamic_size() for a size that depends on the data).");
}

void check_output_sizes_meta(
    c10::string_view /*leaf*/,
    int64_t /*output*/,
    const at::Tensor& /*tensor*/,
    c10::SymIntArrayRef /*expected*/) {}

// Functionalization of the mutating variants (auto_functionalize does not
// handle list returns): call the functional variant on the unwrapped inputs,
// then write the new values back into the functional tensors.
TensorList unwrap(at::TensorList tensors) {
  namespace F = at::functionalization::impl;
  TensorList out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (F::isFunctionalTensor(t)) {
      F::sync(t);
      out.push_back(F::from_functional_tensor(t));
    } else {
      out.push_back(t);
    }
  }
  return out;
}

void write_back(at::TensorList mutated, const TensorList& updated) {
  namespace F = at::functionalization::impl;
  for (size_t i = 0; i < mutated.size(); ++i) {
    if (F::isFunctionalTensor(mutated[i])) {
      F::replace_(mutated[i], updated[i]);
      F::commit_update(mutated[i]);
      F::sync(mutated[i]);
    }
  }
}

// The functional variants: the same work on clones of the mutable inputs,
// whose new values are returned.
TensorList clone_all(at::TensorList tensors) {
  TensorList out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    out.push_back(t.clone());
  }
  return out;
}

std::tuple<TensorList, TensorList> call_functional_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  auto updated = clone_all(mutated);
  auto out = call_mutating_kernel(leaf, plan, inputs, updated);
  return {std::move(out), std::move(updated)};
}

std::tuple<TensorList, TensorList> call_functional_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  return {call_mutating_meta(leaf, plan, inputs, mutated), clone_all(mutated)};
}

std::tuple<TensorList, at::Tensor, TensorList> forward_functional_kernel(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  auto updated = clone_all(mutated);
  auto [out, state] = forward_mutating_kernel(leaf, plan, inputs, updated, differentiable);
  return {std::move(out), std::move(state), std::move(updated)};
}

std::tuple<TensorList, at::Tensor, TensorList> forward_functional_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  auto [out, state] = forward_mutating_meta(leaf, plan, inputs, mutated, differentiable);
  return {std::move(out), std::move(state), clone_all(mutated)};
}

} // namespace

TensorList call_mutating_functionalize(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::call_functional", "")
                       .typed<std::tuple<TensorList, TensorList>(
                           int64_t, int64_t, at::TensorList, at::TensorList)>();
  auto in = unwrap(inputs);
  auto mut = unwrap(mutated);
  std::tuple<TensorList, TensorList> out;
  {
    c10::impl::ExcludeDispatchKeyGuard skip(c10::DispatchKey::Functionalize);
    out = op.call(leaf, plan, in, mut);
  }
  write_back(mutated, std::get<1>(out));
  return at::functionalization::impl::to_functional_tensor(std::get<0>(out));
}

namespace {

std::tuple<TensorList, at::Tensor> forward_mutating_functionalize(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchleaf::forward_functional", "")
                       .typed<std::tuple<TensorList, at::Tensor, TensorList>(
                           int64_t, int64_t, at::TensorList, at::TensorList, at::IntArrayRef)>();
  auto in = unwrap(inputs);
  auto mut = unwrap(mutated);
  std::tuple<TensorList, at::Tensor, TensorList> out;
  {
    c10::impl::ExcludeDispatchKeyGuard skip(c10::DispatchKey::Functionalize);
    out = op.call(leaf, plan, in, mut, differentiable);
  }
  write_back(mutated, std::get<2>(out));
  namespace F = at::functionalization::impl;
  return {F::to_functional_tensor(std::get<0>(out)), F::to_functional_tensor(std::get<1>(out))};
}

} // namespace

TORCH_LIBRARY_IMPL(torchleaf, Functionalize, m) {
  m.impl("call_mutating", &call_mutating_functionalize);
  m.impl("forward_mutating", &forward_mutating_functionalize);
}

TORCH_LIBRARY(torchleaf, m) {
  const auto tags = leaf_operator_tags();
  // (A string literal, or a temporary tag list, would pick def's (schema,
  // kernel) template overload.)
  auto def = [&m](const char* schema, const std::vector<at::Tag>& schema_tags) {
    m.def(schema, schema_tags);
  };
  def("call(int leaf, int plan, Tensor[] inputs) -> Tensor[]", tags);
  // The capturing operators also say that they may draw random numbers
  // (a dropout in the body): when compiled activation checkpointing
  // recomputes one in backward, AOTAutograd then saves the generator's state
  // before the forward's call and restores it around the recomputation
  // (run_and_save_rng_state / run_with_rng_state), so that the replayed
  // graph is the one whose outputs the forward returned.
  auto capturing_tags = tags;
  capturing_tags.push_back(at::Tag::nondeterministic_seeded);
  def(
      "forward(int leaf, int plan, Tensor[] inputs, int[] differentiable) "
      "-> (Tensor[], Tensor)",
      capturing_tags);
  def(
      "call_mutating(int leaf, int plan, Tensor[] inputs, Tensor(a!)[] mutated) "
      "-> Tensor[]",
      tags);
  def(
      "forward_mutating(int leaf, int plan, Tensor[] inputs, "
      "Tensor(a!)[] mutated, int[] differentiable) -> (Tensor[], Tensor)",
      capturing_tags);
  def(
      "call_functional(int leaf, int plan, Tensor[] inputs, Tensor[] mutated) "
      "-> (Tensor[], Tensor[])",
      tags);
  def(
      "forward_functional(int leaf, int plan, Tensor[] inputs, "
      "Tensor[] mutated, int[] differentiable) -> (Tensor[], Tensor, Tensor[])",
      capturing_tags);
  // Inductor passes backward's gradients contiguous: a loss's gradient is
  // often an expand (stride 0), which a fused kernel then writes once,
  // where the replayed aten ops would each copy it for a dense operand (mm
  // does, once per product). Other backends and eager pass them as they are.
  auto backward_tags = tags;
  backward_tags.push_back(at::Tag::needs_contiguous_strides);
  def(
      "backward(int leaf, Tensor state, Tensor?[] grads, SymInt[] input_meta) "
      "-> Tensor[]",
      backward_tags);
  // The batched state handle of a per-sample loop under vmap(grad(leaf))
  // (stack_state_handles). An operator, not a helper, so that a traced
  // vmap(grad(leaf)) records it: the compiled graph stacks the real handles.
  m.def("stack_handles(Tensor[] handles) -> Tensor");
  // An int output of a Python leaf, carried in compiled code as the size of
  // a zero-stride tensor, against the fake's int (`expected`, which the
  // graph computes from its inputs' sizes and uses downstream): a fake whose
  // expression is wrong is an error, not a silently returned value. (The
  // leaf by name: exported programs run in other processes.)
  m.def("check_carried_int(str leaf, Tensor carrier, SymInt expected, bool zigzag) -> ()");
  // The same for a tensor output whose traced sizes are symbolic, which the
  // operator's always-on output check cannot see (output_check.h).
  m.def("check_output_sizes(str leaf, int output, Tensor tensor, SymInt[] expected) -> ()");
}

TORCH_LIBRARY_IMPL(torchleaf, CompositeExplicitAutograd, m) {
  m.impl("call", &call_kernel);
  m.impl("forward", &forward_kernel);
  m.impl("call_mutating", &call_mutating_kernel);
  m.impl("forward_mutating", &forward_mutating_kernel);
  m.impl("call_functional", &call_functional_kernel);
  m.impl("forward_functional", &forward_functional_kernel);
  m.impl("backward", &backward_kernel);
  m.impl("stack_handles", &stack_state_handles);
  m.impl("check_carried_int", &check_carried_int_kernel);
  m.impl("check_output_sizes", &check_output_sizes_kernel);
}

TORCH_LIBRARY_IMPL(torchleaf, Meta, m) {
  m.impl("call", &call_meta);
  m.impl("forward", &forward_meta);
  m.impl("call_mutating", &call_mutating_meta);
  m.impl("forward_mutating", &forward_mutating_meta);
  m.impl("call_functional", &call_functional_meta);
  m.impl("forward_functional", &forward_functional_meta);
  m.impl("backward", &backward_meta);
  m.impl("stack_handles", &stack_handles_meta);
  m.impl("check_carried_int", &check_carried_int_meta);
  m.impl("check_output_sizes", &check_output_sizes_meta);
}

namespace {

// Tensors whose dispatcher round trip does more than reach the kernels: the
// conjugate, negative and zero-tensor fallbacks materialize such inputs.
bool has_fallback_keys(at::TensorList tensors) {
  constexpr auto keys = c10::DispatchKeySet(
      {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
  for (const auto& t : tensors) {
    if (t.key_set().has_any(keys)) {
      return true;
    }
  }
  return false;
}

} // namespace

std::optional<TensorList> call_plain(const LeafEntry& entry, int64_t plan, at::TensorList inputs) {
  if (!is_plain_eager(inputs, {}) || has_fallback_keys(inputs)) {
    return std::nullopt;
  }
  CallSite site{plan};
  return call_eager(entry, inputs, {}, site);
}

std::optional<std::tuple<TensorList, at::Tensor>> forward_plain(
    LeafEntryPtr entry,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable) {
  // With grad mode on, an input that requires grad makes the Autograd kernel
  // refuse a second derivative: that takes the operator.
  if (at::GradMode::is_enabled() || !is_plain_eager(inputs, {}) || has_fallback_keys(inputs)) {
    return std::nullopt;
  }
  const ProfilerRange range("torchleaf::forward");
  check_no_forward_tangents(entry->id, inputs, {});
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return run_forward(std::move(entry), plan, inputs, {}, differentiable);
}

std::optional<TensorList> backward_plain(
    int64_t leaf,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads) {
  // Tensors are looked at in place, never copied: each is a Python tensor's,
  // whose copy and release cost a Python reference count with the GIL
  // released.
  if (at::GradMode::is_enabled() || !is_concrete_handle(state) ||
      !is_plain_eager(at::TensorList(state), {})) {
    return std::nullopt;
  }
  bool tangent = false;
  for (const auto& g : grads) {
    if (g.has_value() && g->defined()) {
      const at::TensorList one(*g);
      if (!is_plain_eager(one, {}) || has_fallback_keys(one)) {
        return std::nullopt;
      }
      tangent = tangent || has_forward_tangent(*g);
    }
  }
  const ProfilerRange range("torchleaf::backward");
  const auto captured = lookup_state(state, leaf);
  if (tangent) { // the error the Autograd kernel raises
    TensorList defined;
    for (const auto& g : grads) {
      if (g.has_value() && g->defined()) {
        defined.push_back(*g);
      }
    }
    check_no_forward_tangents(captured->entry->name, defined, {});
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return run_backward(*captured, state, grads);
}

} // namespace torchleaf::ops
