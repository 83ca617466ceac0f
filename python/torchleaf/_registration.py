"""Registration of torchleaf's operators with PyTorch's Python compile stack:
fake kernels (so FakeTensorMode runs user fakes with full symbolic-shape
support, unbacked sizes included) and ordered effects (so calls are never
dead-code-eliminated or reordered)."""

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

from . import _C
from ._leaf import _CALLS, _run_fake

# c10::ScalarType code -> torch.dtype, for decoding backward's input metadata.
_DTYPES = {}
for _dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
):
    _DTYPES[_C.scalar_type_code(torch.empty(0, dtype=_dtype))] = _dtype


def _fake_leaf(leaf, inputs, mutated):
    call = _CALLS.get(leaf)
    if call is not None:
        return _run_fake(list(inputs) + list(mutated), call)
    return _C.run_fake(leaf, list(inputs), list(mutated))  # a C++ leaf


def _fake_call(leaf, inputs):
    return _fake_leaf(leaf, inputs, ())


def _fake_forward(leaf, inputs, differentiable):
    return _fake_leaf(leaf, inputs, ()), torch.empty((), dtype=torch.int64)


def _fake_call_mutating(leaf, inputs, mutated):
    return _fake_leaf(leaf, inputs, mutated)


def _fake_forward_mutating(leaf, inputs, mutated, differentiable):
    return _fake_leaf(leaf, inputs, mutated), torch.empty((), dtype=torch.int64)


def _fake_call_functional(leaf, inputs, mutated):
    return _fake_leaf(leaf, inputs, mutated), [torch.empty_like(t) for t in mutated]


def _fake_forward_functional(leaf, inputs, mutated, differentiable):
    outputs, state = _fake_forward_mutating(leaf, inputs, mutated, differentiable)
    return outputs, state, [torch.empty_like(t) for t in mutated]


def _fake_backward(leaf, state, grads, input_meta):
    grads_out = []
    i = 0
    while i < len(input_meta):
        dtype = _DTYPES[int(input_meta[i])]
        index = int(input_meta[i + 2])
        device = torch.device(_C.device_type_name(int(input_meta[i + 1])), index if index >= 0 else None)
        ndim = int(input_meta[i + 3])
        grads_out.append(torch.empty(list(input_meta[i + 4 : i + 4 + ndim]), dtype=dtype, device=device))
        i += 4 + ndim
    return grads_out


_registered_named = set()


def _register_ops():
    torch.library.register_fake("torchleaf::call", _fake_call)
    torch.library.register_fake("torchleaf::forward", _fake_forward)
    torch.library.register_fake("torchleaf::call_mutating", _fake_call_mutating)
    torch.library.register_fake("torchleaf::forward_mutating", _fake_forward_mutating)
    torch.library.register_fake("torchleaf::call_functional", _fake_call_functional)
    torch.library.register_fake("torchleaf::forward_functional", _fake_forward_functional)
    torch.library.register_fake("torchleaf::backward", _fake_backward)
    # Every operator that runs user code in a functional graph is ordered.
    # (The mutating variants cannot carry effects, PyTorch excludes mutable
    # operators; they are functionalized into the functional variants.)
    # `backward` only replays a graph captured by its forward, so it needs no
    # order of its own; leaving it out saves a with_effects wrapper per call.
    for op in (
        torch.ops.torchleaf.call,
        torch.ops.torchleaf.forward,
        torch.ops.torchleaf.call_functional,
        torch.ops.torchleaf.forward_functional,
    ):
        _register_effectful_op(op.default, _EffectType.ORDERED)
    sync_cpp_leaves()


def sync_cpp_leaves():
    """Register fakes and effects for C++ leaves defined since the last sync
    (call after loading a library that defines leaves)."""
    for leaf_id, name, mutable in _C.named_leaves():
        if name in _registered_named:
            continue
        _registered_named.add(name)

        def fake(inputs, mutated=(), _id=leaf_id):
            return _C.run_fake(_id, list(inputs), list(mutated))

        torch.library.register_fake(name, fake)
        if not mutable:
            namespace, opname = name.split("::")
            _register_effectful_op(getattr(getattr(torch.ops, namespace), opname).default, _EffectType.ORDERED)
