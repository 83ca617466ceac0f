// The dense (CompositeExplicitAutograd) and Meta kernels of the torchleaf
// operators: the real and fake work of a leaf call, forward, backward, and
// the output checks of compiled code.

#include <ATen/ATen.h>

#include <torchleaf/errors.h>

#include "../capture.h"
#include "../state.h"
#include "../torch_private.h"
#include "kernels.h"
#include "leaf_ops.h"

namespace torchleaf::ops {

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
  entry.fake_outputs.record(
      site.plan, flat.tensors, outputs, strides_relied_on);
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

} // namespace

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
  CallSite site{plan};
  auto call =
      run_real_captured(*entry, flat.tensors, flat.is_mutable, site, mask);
  std::shared_ptr<CapturedState> state = std::move(call.state);
  if (state == nullptr) { // nothing differentiable: an empty graph
    state = std::make_shared<CapturedState>();
    state->entry = entry;
    state->output_edges.resize(call.outputs.size());
  }
  return {std::move(call.outputs), make_state_handle(std::move(state))};
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
  return {
      call_mutating_meta(leaf, plan, inputs, mutated),
      at::empty({}, at::TensorOptions().dtype(at::kLong).device(at::kMeta))};
}

std::tuple<TensorList, at::Tensor> forward_meta(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable) {
  return forward_mutating_meta(leaf, plan, inputs, {}, differentiable);
}

namespace {

std::vector<std::optional<at::Tensor>> to_vector(
    const c10::List<std::optional<at::Tensor>>& grads) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(grads.size());
  for (const auto& g : grads) {
    out.push_back(g);
  }
  return out;
}

} // namespace

TensorList run_backward(
    const CapturedState& captured,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads) {
  // A compiled graph's backward with create_graph=True: AOTAutograd runs it
  // inside the forward of an autograd.Function (CompiledFunctionBackward)
  // whose inputs are the graph's saved tensors and whose own backward
  // raises. A leaf's graph saves its state handle, not its inputs, so a
  // second derivative that autograd.grad asks for reaches no input: None or
  // zero, silently (issue 36). Told apart from an ordinary backward by
  // forward-grad mode, which a Function's forward turns off and the engine
  // leaves on (create_graph also keeps the graph).
  TORCHLEAF_CHECK(
      !(torch_private::current_graph_task_id() != -1 &&
        torch_private::current_graph_task_keep_graph() &&
        !torch_private::forward_grad_mode_enabled()),
      captured.entry->name,
      "was called in a compiled graph whose backward runs with create_graph=True: "
      "torch.compile (AOTAutograd) cannot differentiate a compiled graph's gradient "
      "again, and the second-order term through the leaf would be missing (None or "
      "zero) without an error. Take higher derivatives of eager calls of the leaf "
      "(call it outside torch.compile, or wrap the call in torch.compiler.disable), "
      "or use create_graph=False.");
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
  std::vector<c10::SymInt> sizes{
      c10::SymInt(static_cast<int64_t>(handles.size()))};
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
  for (const auto& meta : decode_input_meta(
           entry ? entry->name : c10::str("<id ", leaf, ">"), input_meta)) {
    out.push_back(at::empty_symint(
        meta.sizes, at::TensorOptions().dtype(meta.dtype).device(at::kMeta)));
  }
  return out;
}

namespace {

// The int a carrier's size codes (Python leaves' _int_of_carrier).
int64_t carried_value(int64_t size, bool zigzag) {
  return !zigzag ? size : size % 2 == 0 ? size / 2 : -(size + 1) / 2;
}

} // namespace

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

} // namespace torchleaf::ops
