#pragma once

// The torchleaf operators. Schemas are defined once, in leaf_ops.cpp:
//
//   torchleaf::call(int leaf, int plan, Tensor[] inputs) -> Tensor[]
//       Runs a leaf. `plan` says how a Python leaf rebuilds its arguments
//       from the tensors (0 for C++ leaves). Its Autograd kernel turns a
//       differentiable call into `forward` plus an autograd node whose
//       backward is `backward`.
//   torchleaf::forward(int leaf, int plan, Tensor[] inputs,
//                      int[] differentiable) -> (Tensor[], Tensor)
//       Runs a leaf and captures its autograd graph for the inputs listed in
//       `differentiable`; the second output is the state handle.
//   torchleaf::call_mutating / forward_mutating: the same with an extra
//       `Tensor(a!)[] mutated` list for declared in-place mutation. They are
//       separate operators because ordered effects and automatic
//       functionalization both exclude mutable operators with list returns;
//       these have Functionalize kernels that call the functional variants
//       call_functional / forward_functional, which run on clones of the
//       mutable inputs and return their new values as extra outputs.
//   torchleaf::backward(int leaf, Tensor state, Tensor?[] grads,
//                       SymInt[] input_meta) -> Tensor[]
//       Replays a captured graph: one gradient per differentiable input.
//   torchleaf::check_carried_int(str leaf, Tensor carrier, SymInt expected,
//                                bool zigzag) -> ()
//       Compares a Python leaf's int output, carried in traced code as the
//       size of a zero-stride tensor, with the fake's int that the graph
//       uses downstream; an error naming the leaf when they differ.
//   torchleaf::check_output_sizes(str leaf, int output, Tensor tensor,
//                                 SymInt[] expected) -> ()
//       The same for a tensor output whose traced sizes are symbolic.
//
// C++ leaves also own a named operator `ns::name(Tensor[] inputs
// [, Tensor(a!)[] mutated]) -> Tensor[]` with the same kernels as `call`.

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>
#include <vector>

#include <torchleaf/export.h>

#include "../registry.h"

namespace torchleaf::ops {

// Bumped whenever an operator schema, the meaning of its arguments or the
// code Inductor must generate around it changes. PyTorch's on-disk compile
// caches key C++ leaves' graphs by the leaf's named operator alone, so the
// Python package adds this to their key (torch.compiler.config.cache_key_tag):
// a cached graph that calls the old operators is never reused. (3: Inductor
// no longer reuses a capturing operator's input buffers, and every leaf
// operator is tagged cudagraph_unsafe. 4: Inductor copies an input of a
// capturing operator that a later node of the graph writes to;
// torchleaf::stack_handles; the capturing operators are tagged
// nondeterministic_seeded. 5: torchleaf::check_carried_int and
// check_output_sizes.)
constexpr int64_t kOperatorSchemaVersion = 5;

// Tags of every operator that runs a leaf's functions. cudagraph_unsafe:
// a CUDA graph replays the kernels one call launched, so the function (its
// control flow, its side effects, its host synchronizations) would never
// run again; Inductor leaves graphs with such operators out of CUDA graphs
// (torch.compile mode="reduce-overhead"), or partitions around them.
inline std::vector<at::Tag> leaf_operator_tags() {
  return {at::Tag::cudagraph_unsafe};
}

// Calls through the dispatcher (all keys); an empty `mutated` selects the
// non-mutating operator.
TORCHLEAF_API TensorList
call(int64_t leaf, int64_t plan, at::TensorList inputs, at::TensorList mutated);
TORCHLEAF_API std::tuple<TensorList, at::Tensor> forward(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated,
    at::IntArrayRef differentiable);
TORCHLEAF_API TensorList backward(
    int64_t leaf,
    const at::Tensor& state,
    const c10::List<std::optional<at::Tensor>>& grads,
    c10::SymIntArrayRef input_meta);

// The flat input list the leaf's functions see: `inputs` and `mutated`
// merged back into the leaf's declared order (C++ leaves) or concatenated
// (Python leaves, whose wrapper orders mutated tensors last).
struct FlatInputs {
  TensorList tensors;
  // Position in `tensors` of every entry of `inputs`.
  c10::SmallVector<size_t, 8> input_positions;
  // Whether each of `tensors` came from `mutated` (may be mutated in place);
  // empty: none did.
  InputFlags is_mutable;
};
FlatInputs merge_inputs(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated);

// Fails with a clear error naming the leaf when any input carries a
// forward-mode AD tangent (make_dual, torch.func.jvp): the captured graph
// only runs backward, so the tangent would be lost without a word.
void check_no_forward_tangents(
    const std::string& leaf_name,
    at::TensorList inputs,
    at::TensorList mutated);

// The same for a caller that has only the leaf's id: the registry is asked
// for the leaf's name only when there is an error to name it in (compiled
// graphs call forward on every step, and never with a tangent).
void check_no_forward_tangents(
    int64_t leaf,
    at::TensorList inputs,
    at::TensorList mutated);

// Kernels shared by `call` and the named operators. `site` carries the plan
// in and the real function's output description out.
TORCHLEAF_API TensorList call_real(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site);
// `strides_relied_on`: the caller compiles code that relies on the fake
// outputs' strides (Inductor), which the real calls are then checked against
// (output_check.h).
TORCHLEAF_API TensorList call_fake(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site,
    bool strides_relied_on = false);

// The Autograd kernel's work for any leaf operator. Returns nullopt when no
// gradient is needed: the caller then redispatches below Autograd.
std::optional<TensorList> call_autograd(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site);

// True when nothing records this call: no Python dispatch mode or functorch
// transform is active and every input is a plain, non-meta tensor. Such a
// call means the same through the dispatcher or through call_eager.
TORCHLEAF_API bool is_plain_eager(
    at::TensorList inputs,
    at::TensorList mutated);

// A plain eager call (is_plain_eager) without the dispatcher round trip, so
// that `site` (the caller's arguments in, the output description out)
// travels with the call: what the operator's Autograd and dense kernels do.
TORCHLEAF_API TensorList call_eager(
    const LeafEntry& entry,
    at::TensorList inputs,
    at::TensorList mutated,
    CallSite& site);

// call, forward and backward of a plain call (is_plain_eager; for forward
// and backward also grad mode off: each step of a compiled graph) without
// the dispatcher's round trips: what their Autograd and dense kernels do for
// such a call, recorded for profilers under the operator's name. nullopt
// when the call is not plain: call call(), forward() or backward() instead.
TORCHLEAF_API std::optional<TensorList> call_plain(
    const LeafEntry& entry,
    int64_t plan,
    at::TensorList inputs);
TORCHLEAF_API std::optional<std::tuple<TensorList, at::Tensor>> forward_plain(
    LeafEntryPtr entry,
    int64_t plan,
    at::TensorList inputs,
    at::IntArrayRef differentiable);
TORCHLEAF_API std::optional<TensorList> backward_plain(
    int64_t leaf,
    const at::Tensor& state,
    const std::vector<std::optional<at::Tensor>>& grads);

// Functionalization of a mutating leaf call: the functional variant on the
// unwrapped inputs, with the new values written back (also the Functionalize
// kernel of named operators that declare mutation).
TensorList call_mutating_functionalize(
    int64_t leaf,
    int64_t plan,
    at::TensorList inputs,
    at::TensorList mutated);

// Encoding of differentiable inputs' metadata for `backward`'s fake kernel:
// per input [dtype, device type, device index, ndim, sizes...].
void append_input_meta(std::vector<c10::SymInt>& meta, const at::Tensor& t);

struct DecodedInputMeta {
  at::ScalarType dtype;
  c10::Device device;
  std::vector<c10::SymInt> sizes;
};
// The inverse of append_input_meta, checked: malformed metadata (it reaches
// torchleaf::backward from any C++ caller) is a clear error naming the leaf.
TORCHLEAF_API std::vector<DecodedInputMeta> decode_input_meta(
    const std::string& leaf_name,
    c10::SymIntArrayRef meta);

} // namespace torchleaf::ops
