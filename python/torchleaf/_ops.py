"""Registration of torchleaf's operators with PyTorch's Python compile stack:
fake kernels (so FakeTensorMode runs user fakes with full symbolic-shape
support, unbacked sizes included), and what keeps calls from being
dead-code-eliminated or reordered."""

import functools
import inspect

import torch
from torch.fx.node import has_side_effect

from . import _C, _functorch
from . import _torch_private as torch_private
from ._errors import LeafFunctionError
from ._inductor import keep_captured_inputs
from ._torch_private import EffectType, inductor_is_lowering, register_effectful_op

# c10::ScalarType code -> torch.dtype, for decoding backward's input metadata.
_DTYPES = {}
for _dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
):
    _DTYPES[_C.scalar_type_code(torch.empty(0, dtype=_dtype))] = _dtype


# One fake for every leaf operator: the core runs the leaf's fake (a Python
# leaf's through its trampoline, a C++ leaf's directly).
def _fake_call(leaf, plan, inputs):
    return _C.run_fake(leaf, plan, list(inputs), [], inductor_is_lowering())


def _fake_forward(leaf, plan, inputs, differentiable):
    keep_captured_inputs()
    return _fake_call(leaf, plan, inputs), torch.empty((), dtype=torch.int64)


def _fake_call_mutating(leaf, plan, inputs, mutated):
    return _C.run_fake(leaf, plan, list(inputs), list(mutated), inductor_is_lowering())


def _fake_forward_mutating(leaf, plan, inputs, mutated, differentiable):
    keep_captured_inputs()
    return _fake_call_mutating(leaf, plan, inputs, mutated), torch.empty((), dtype=torch.int64)


def _fake_call_functional(leaf, plan, inputs, mutated):
    return _fake_call_mutating(leaf, plan, inputs, mutated), [torch.empty_like(t) for t in mutated]


def _fake_forward_functional(leaf, plan, inputs, mutated, differentiable):
    outputs, state = _fake_forward_mutating(leaf, plan, inputs, mutated, differentiable)
    return outputs, state, [torch.empty_like(t) for t in mutated]


def _malformed_meta(leaf, input_meta, at, what):
    return LeafFunctionError(
        f"torchleaf: leaf function with id {leaf} backward received malformed input_meta "
        f"({len(input_meta)} entries; at entry {at}: {what}). input_meta must hold [dtype, device "
        f"type, device index, ndim, sizes...] per differentiable input, as torchleaf::forward's "
        f"Autograd kernel records it; pass it through unchanged."
    )


def _fake_backward(leaf, state, grads, input_meta):
    # The mirror of the C++ Meta kernel (decode_input_meta), producing fake
    # tensors on the inputs' devices rather than meta tensors.
    grads_out = []
    i = 0
    n = len(input_meta)
    while i < n:
        if n - i < 4:
            raise _malformed_meta(leaf, input_meta, i, "a record shorter than its 4-entry header")
        dtype = _DTYPES.get(int(input_meta[i]))
        if dtype is None:
            raise _malformed_meta(leaf, input_meta, i, f"dtype code {input_meta[i]} is not a floating type")
        index = int(input_meta[i + 2])
        device_type = _C.device_type_name(int(input_meta[i + 1]))
        device = torch.device(device_type, index) if index >= 0 else torch.device(device_type)
        ndim = int(input_meta[i + 3])
        if ndim < 0 or ndim > n - i - 4:
            raise _malformed_meta(leaf, input_meta, i + 3, f"ndim {ndim} does not fit the remaining entries")
        grads_out.append(torch.empty(list(input_meta[i + 4 : i + 4 + ndim]), dtype=dtype, device=device))
        i += 4 + ndim
    return grads_out


def _fake_check_carried_int(leaf, carrier, expected, zigzag):
    keep_captured_inputs()  # installs the lowering that drops the carrier's assert
    return None  # the fake's int is `expected` itself


def _fake_check_output_sizes(leaf, output, tensor, expected):
    keep_captured_inputs()  # installs the lowering that drops the operator
    return None


def _fake_stack_handles(handles):
    return handles[0].new_empty((len(handles), *handles[0].shape))


_registered_named: set[str] = set()


def _install_direct_entries():
    """Let compiled graphs call torchleaf::call/forward/backward without
    PyTorch's generic boxed entry (see csrc/python/operator_entries.cpp).
    Runs before anything hashes these OpOverloads: their hash is their
    `_op`'s."""
    for name in ("call", "forward", "backward"):
        overload = getattr(torch.ops.torchleaf, name).default
        torch_private.set_op_overload_entry(overload, functools.partial(_C.direct_operator_entry, name))


def _register_fake(name, fake):
    """torch.library.register_fake over the operator's C++ Meta kernel (which
    C++ callers use): the Python fake runs user fakes with full symbolic-shape
    support. Through 2.11 register_fake refuses an operator with a Meta
    kernel unless told to override it; later releases override by default."""
    torch.library.register_fake(name, fake, allow_override=True)


def register_ops():
    _install_direct_entries()
    _register_fake("torchleaf::call", _fake_call)
    _register_fake("torchleaf::forward", _fake_forward)
    _register_fake("torchleaf::call_mutating", _fake_call_mutating)
    _register_fake("torchleaf::forward_mutating", _fake_forward_mutating)
    _register_fake("torchleaf::call_functional", _fake_call_functional)
    _register_fake("torchleaf::forward_functional", _fake_forward_functional)
    _register_fake("torchleaf::backward", _fake_backward)
    _register_fake("torchleaf::stack_handles", _fake_stack_handles)
    _register_fake("torchleaf::check_carried_int", _fake_check_carried_int)
    _register_fake("torchleaf::check_output_sizes", _fake_check_output_sizes)
    # Operators that run user code are never dead code (FX and Inductor keep
    # impure operators). Python leaves' compiled calls are ordered by the
    # token they thread (_dynamo._ORDER_TOKEN), a data dependency that costs
    # nothing at run time; PyTorch's effect tokens would wrap every call in
    # the with_effects higher-order operator, which runs in Python under
    # aot_eager. C++ leaves' named operators keep effect tokens (see below).
    for op in (
        torch.ops.torchleaf.call,
        torch.ops.torchleaf.forward,
        torch.ops.torchleaf.call_functional,
        torch.ops.torchleaf.forward_functional,
        torch.ops.torchleaf.call_mutating,
        torch.ops.torchleaf.forward_mutating,
        torch.ops.torchleaf.check_carried_int,
        torch.ops.torchleaf.check_output_sizes,
    ):
        has_side_effect(op.default)
    # Batching rules (torch.func.vmap): a per-sample loop, or a Python leaf's
    # own rule (LeafFunction.register_vmap).
    _functorch.register_rules()
    _let_rng_state_wrappers_find_listed_tensors()
    _C._set_saved_hook_may_copy(_saved_hook_may_copy)
    sync_cpp_leaves()


def _saved_hook_may_copy(pack_hook):
    """Whether the saved-tensor pack hook `pack_hook` may save a copy of a
    state handle, for which the core must keep the state until a backward
    consumes it. Checkpointing's never does: a state kept under it would
    never be consumed (backward replays the recomputation's state), one per
    step, with the body's saved activations. Other hooks (save_on_cpu, user
    hooks) may."""
    fn = inspect.unwrap(pack_hook)  # (the recomputation's is wrapped by Dynamo's disable)
    module, qualnames = torch_private.CHECKPOINT_PACK_HOOKS
    return not (getattr(fn, "__module__", None) == module and getattr(fn, "__qualname__", None) in qualnames)


def _let_rng_state_wrappers_find_listed_tensors():
    """The capturing operators are tagged nondeterministic_seeded, so that
    AOTAutograd runs a call that activation checkpointing recomputes under
    ``run_and_save_rng_state`` in forward and ``run_with_rng_state`` in
    backward: the recomputation draws the forward's random numbers. Those
    wrappers pick the generator (CPU, CUDA, ...) by the device of the first
    top-level tensor argument (``rng_prims.get_device``), and the capturing
    operators pass their tensors in a list: the wrappers raised "Backend not
    supported for None". This looks in list arguments where the original
    finds nothing (private, listed in docs/design.md)."""
    rng_prims = torch_private.rng_prims()
    original = rng_prims.get_device
    if getattr(original, "_torchleaf", False):
        return

    def get_device(args, kwargs):
        device = original(args, kwargs)
        if device is None:
            for arg in args:
                if isinstance(arg, (list, tuple)):
                    for t in arg:
                        if isinstance(t, torch.Tensor):
                            return t.device.type
        return device

    get_device._torchleaf = True  # type: ignore[attr-defined]
    rng_prims.get_device = get_device  # type: ignore[attr-defined]


def named_op(name):
    """The OpOverloadPacket of the operator "ns::op"."""
    namespace, opname = name.split("::")
    return getattr(getattr(torch.ops, namespace), opname)


def _register_named(name, fake, mutating):
    """Register a named leaf operator's fake and, unless it declares
    mutation (which orders it already), its ordered effect; once per name.
    Returns whether this call registered them."""
    if name in _registered_named:
        return False
    _registered_named.add(name)
    _register_fake(name, fake)
    if not mutating:
        register_effectful_op(named_op(name).default, EffectType.ORDERED)
    return True


def sync_cpp_leaves():
    """Make C++ leaves defined since the last sync traceable from Python.

    Registers each new C++ leaf's fake and ordered effect with PyTorch's
    Python compile stack. :func:`torchleaf.load_library` calls it; call it
    yourself after loading a library some other way (``ctypes``,
    ``torch.ops.load_library``).

    Example:
        >>> torch.ops.load_library("build/libmyleaves.so")  # doctest: +SKIP
        >>> torchleaf.sync_cpp_leaves()                     # doctest: +SKIP
    """
    for leaf_id, name, mutable in _C.named_leaves():

        def fake(inputs, mutated=(), _id=leaf_id):
            return _C.run_fake(_id, 0, list(inputs), list(mutated), inductor_is_lowering())

        if _register_named(name, fake, bool(mutable)):
            _functorch.register_named_rule(name, bool(mutable))


def register_named_python_leaf(name, mutating, fake):
    """Register the fake and effect of a named Python leaf's operator, once
    per name (the operator outlives its leaf, and a leaf defined again under
    the same name binds to it); returns its OpOverloadPacket."""
    _register_named(name, fake, mutating)
    return named_op(name)
