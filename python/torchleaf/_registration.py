"""Registration of torchleaf's operators with PyTorch's Python compile stack:
fake kernels (so FakeTensorMode runs user fakes with full symbolic-shape
support, unbacked sizes included), and what keeps calls from being
dead-code-eliminated or reordered."""

import inspect
import sys
import weakref

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
from torch.fx.node import has_side_effect

from . import _C, _functorch
from ._errors import LeafFunctionError

# c10::ScalarType code -> torch.dtype, for decoding backward's input metadata.
_DTYPES = {}
for _dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
):
    _DTYPES[_C.scalar_type_code(torch.empty(0, dtype=_dtype))] = _dtype


def _strides_relied_on():
    """Whether Inductor is lowering a graph now. It asserts the strides of its
    extern kernels' outputs (assert_size_stride), so real calls are checked
    against the fake's strides only when such a trace recorded them; other
    graphs run with whatever layout the real function returns."""
    graph = sys.modules.get("torch._inductor.graph")
    if graph is None:
        return False
    from torch._inductor.virtualized import _graph

    return isinstance(_graph._get_handler(check_poisoned=False), graph.GraphLowering)


# One fake for every leaf operator: the core runs the leaf's fake (a Python
# leaf's through its trampoline, a C++ leaf's directly).
def _fake_call(leaf, plan, inputs):
    return _C.run_fake(leaf, plan, list(inputs), [], _strides_relied_on())


def _fake_forward(leaf, plan, inputs, differentiable):
    _keep_captured_inputs_in_inductor()
    return _fake_call(leaf, plan, inputs), torch.empty((), dtype=torch.int64)


def _fake_call_mutating(leaf, plan, inputs, mutated):
    return _C.run_fake(leaf, plan, list(inputs), list(mutated), _strides_relied_on())


def _fake_forward_mutating(leaf, plan, inputs, mutated, differentiable):
    _keep_captured_inputs_in_inductor()
    return _fake_call_mutating(leaf, plan, inputs, mutated), torch.empty((), dtype=torch.int64)


def _fake_call_functional(leaf, plan, inputs, mutated):
    return _fake_call_mutating(leaf, plan, inputs, mutated), [torch.empty_like(t) for t in mutated]


def _fake_forward_functional(leaf, plan, inputs, mutated, differentiable):
    outputs, state = _fake_forward_mutating(leaf, plan, inputs, mutated, differentiable)
    return outputs, state, [torch.empty_like(t) for t in mutated]


# The operators whose real kernel captures its body's autograd graph.
_CAPTURING_OPS = ("forward", "forward_mutating", "forward_functional")


def _keep_captured_inputs_in_inductor():
    """Make Inductor keep the buffers it passes to a capturing operator.

    Inductor reuses a buffer once its last reader has run: it writes the next
    kernel's result into it. The graph a capturing call recorded may have
    saved one of its inputs for backward (``sin`` saves its input, ``mm``
    both operands), without Inductor knowing, so a later kernel of the same
    graph would overwrite what the replay reads: wrong gradients, silently.
    A copy of every input would cost each call a copy whether or not
    anything was saved; instead the inputs of these operators are never
    reused (they are still freed when dead; what the captured graph holds
    stays valid). Inductor marks buffers so with
    ``V.graph.never_reuse_buffers`` in its own lowerings (``set_``,
    ``resize_storage_bytes_``); there is no public API, so this wraps the
    lowering Inductor would create for the operator (private, listed in
    docs/design.md).

    Called by the capturing operators' fakes (and the check operators', whose
    lowerings are wrapped or replaced here too), which run while AOTAutograd
    traces a graph, before Inductor lowers it; a no-op until Inductor is
    imported (importing it here would cost every ``import torchleaf``)."""
    if _inductor_lowerings_installed or "torch._inductor.lowering" not in sys.modules:
        return
    _install_inductor_lowerings()


_inductor_lowerings_installed = False


def _install_inductor_lowerings():
    global _inductor_lowerings_installed
    import functools

    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V
    from torch._library.utils import get_layout_constraint_tag

    clone = lowering.lowerings[torch.ops.aten.clone.default]
    capturing = {getattr(torch.ops.torchleaf, name).default for name in _CAPTURING_OPS}

    def ensure_fallback(op):
        if op not in lowering.lowerings:
            # What GraphLowering.call_function makes for an operator without
            # a lowering (an implicit fallback with its default layout
            # constraint), made ahead of time so that it can be wrapped.
            tag = get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))

    def wrap(target, inputs_at, op_at=None):
        """Wraps the lowering of `target`, whose argument `inputs_at` is a
        capturing call's input list; with `op_at`, only where the argument
        there (the operator a higher-order operator runs) is capturing."""
        fallback = lowering.lowerings[target]

        @functools.wraps(fallback)
        def keep_inputs(*args, **kwargs):
            if op_at is not None and not (len(args) > op_at and args[op_at] in capturing):
                return fallback(*args, **kwargs)
            args = _copy_inputs_written_later(args, inputs_at, clone)
            first = len(V.graph.operations)
            result = fallback(*args, **kwargs)
            for operation in V.graph.operations[first:]:
                if isinstance(operation, ir.FallbackKernel):
                    for buffer in operation.inputs:
                        try:
                            V.graph.never_reuse_buffers.add(buffer.get_name())
                        except (AttributeError, NotImplementedError):
                            pass  # not a buffer (a constant, an opaque object)
                elif op_at is None and _is_output(operation, ir, _STATE_HANDLE_INDEX):
                    _skip_size_check(operation)
            return result

        lowering.lowerings[target] = keep_inputs

    def skip_checks_of_backward(target):
        fallback = lowering.lowerings[target]

        @functools.wraps(fallback)
        def unchecked_backward(*args, **kwargs):
            first = len(V.graph.operations)
            result = fallback(*args, **kwargs)
            for operation in V.graph.operations[first:]:
                if _is_output(operation, ir, None):
                    _skip_size_check(operation)
            state = args[1] if len(args) > 1 else kwargs.get("state")
            try:
                name = state.get_name()
            except (AttributeError, NotImplementedError):
                name = None
            if name in V.graph.graph_inputs:
                _unchecked_graph_inputs.setdefault(V.graph, set()).add(name)
            return result

        lowering.lowerings[target] = unchecked_backward

    def skip_check_of_carrier(target):
        fallback = lowering.lowerings[target]

        @functools.wraps(fallback)
        def checked_by_the_operator(*args, **kwargs):
            # The carrier's size is what the operator checks, with an error
            # naming the leaf: Inductor's assert of it would fail first.
            carrier = args[1] if len(args) > 1 else kwargs.get("carrier")
            try:
                buffer = V.graph.get_buffer(carrier.get_name())
            except (AttributeError, NotImplementedError):
                buffer = None
            if isinstance(buffer, ir.MultiOutput):
                _skip_size_check(buffer)
            return fallback(*args, **kwargs)

        lowering.lowerings[target] = checked_by_the_operator

    # A graph's input asserts are made when its wrapper code is generated,
    # after lowering: drop those of the state handles found above.
    from torch._inductor.codegen import wrapper as wrapper_codegen

    codegen = wrapper_codegen.PythonWrapperCodegen
    input_asserts = codegen.codegen_input_size_asserts

    @functools.wraps(input_asserts)
    def codegen_input_size_asserts(self):
        input_asserts(self)
        pending = getattr(self, "_pending_input_asserts", None)
        for name in _unchecked_graph_inputs.get(V.graph, ()):
            if pending is not None:
                pending.pop(name, None)

    codegen.codegen_input_size_asserts = codegen_input_size_asserts

    for op in capturing:
        ensure_fallback(op)
        wrap(op, inputs_at=2)
    ensure_fallback(torch.ops.torchleaf.backward.default)
    skip_checks_of_backward(torch.ops.torchleaf.backward.default)
    ensure_fallback(torch.ops.torchleaf.check_carried_int.default)
    skip_check_of_carrier(torch.ops.torchleaf.check_carried_int.default)
    # Inductor asserts the size of every extern kernel output it uses itself:
    # check_output_sizes would check them again.
    lowering.lowerings[torch.ops.torchleaf.check_output_sizes.default] = lambda *args, **kwargs: None
    # A call that compiled activation checkpointing recomputes runs inside
    # these (the generator's state saved around the forward's call, restored
    # around the recomputation): run_and_save_rng_state(op, leaf, plan,
    # inputs, ...) and run_with_rng_state(state, op, leaf, plan, inputs, ...).
    rng_prims = torch._prims.rng_prims
    wrap(rng_prims.run_and_save_rng_state, inputs_at=3, op_at=0)
    wrap(rng_prims.run_with_rng_state, inputs_at=4, op_at=1)
    _inductor_lowerings_installed = True


# A capturing operator's outputs are (outputs, state handle, ...).
_STATE_HANDLE_INDEX = 1


def _is_output(operation, ir, index):
    """Whether `operation` takes one output of a torchleaf operator's
    FallbackKernel: the top-level output `index`, or any with None."""
    if not isinstance(operation, ir.MultiOutput) or not isinstance(
        operation.inputs[0], ir.FallbackKernel
    ):
        return False
    return index is None or (len(operation.indices) == 1 and operation.indices[0][1] == index)


def _skip_size_check(output):
    """Drop Inductor's size and stride assert of an output the core already
    guarantees: the state handle (a 0-dim int64 tensor that only the
    backward operator reads) and the backward operator's gradients (each
    validated against its input's metadata by the replay, as the autograd
    engine validates a node's outputs, and made contiguous, as the fake
    promises). Each assert builds a stringstream before comparing: ~4k
    instructions, ~0.4 µs per step."""
    output.skip_size_stride_alignment_checks = True


# Per graph being lowered: the names of its inputs that are state handles
# read by the backward operator (their asserts are dropped, _skip_size_check).
_unchecked_graph_inputs = weakref.WeakKeyDictionary()


# Per graph being lowered: each FX node's position, and for each storage the
# position of the last node that writes to it.
_graph_writes = weakref.WeakKeyDictionary()


def _storage_of(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(val.untyped_storage())


def _writes_of(graph):
    known = _graph_writes.get(graph)
    if known is None:
        positions, last_write = {}, {}
        for i, node in enumerate(graph.module.graph.nodes):
            positions[node] = i
            schema = getattr(node.target, "_schema", None)
            if node.op != "call_function" or schema is None or not schema.is_mutable:
                continue
            for k, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
                for written in value if isinstance(value, (list, tuple)) else (value,):
                    storage = _storage_of(written)
                    if storage is not None:
                        last_write[storage] = i
        known = _graph_writes[graph] = (positions, last_write)
    return known


def _copy_inputs_written_later(args, inputs_at, clone):
    """The inputs of a capturing call, with a copy for each one that a later
    node of the graph writes to.

    The captured graph may have saved an input for backward. In eager mode,
    or under aot_eager, a later in-place change of it bumps its version
    counter and the replay refuses it ("modified by an inplace operation").
    Inductor writes a graph input's mutation (``w.add_(1)`` after the call,
    kept in the graph as ``copy_``), or an in-place custom operator it
    re-inplaced, straight into the buffer, and bumps the version before the
    graph runs: the replay would read the new values, silently. Those inputs
    alone get a copy, so the replay sees the values the call saw; a graph
    without such writes pays nothing."""
    from torch._inductor.virtualized import V

    node = V.graph.current_node
    if node is None or len(args) <= inputs_at or len(node.args) <= inputs_at:
        return args
    positions, last_write = _writes_of(V.graph)
    here = positions.get(node)
    if here is None or not last_write:
        return args
    inputs = list(args[inputs_at])
    copied = False
    for k, input_node in enumerate(node.args[inputs_at]):
        if last_write.get(_storage_of(input_node), -1) > here:
            inputs[k] = clone(inputs[k])
            copied = True
    if not copied:
        return args
    return (*args[:inputs_at], inputs, *args[inputs_at + 1 :])


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
        device = torch.device(_C.device_type_name(int(input_meta[i + 1])), index if index >= 0 else None)
        ndim = int(input_meta[i + 3])
        if ndim < 0 or ndim > n - i - 4:
            raise _malformed_meta(leaf, input_meta, i + 3, f"ndim {ndim} does not fit the remaining entries")
        grads_out.append(torch.empty(list(input_meta[i + 4 : i + 4 + ndim]), dtype=dtype, device=device))
        i += 4 + ndim
    return grads_out


def _fake_check_carried_int(leaf, carrier, expected, zigzag):
    _keep_captured_inputs_in_inductor()  # installs the lowering that drops the carrier's assert
    return None  # the fake's int is `expected` itself


def _fake_check_output_sizes(leaf, output, tensor, expected):
    _keep_captured_inputs_in_inductor()  # installs the lowering that drops the operator
    return None


def _fake_stack_handles(handles):
    return handles[0].new_empty((len(handles), *handles[0].shape))


_registered_named = set()


def _install_direct_entries():
    """Let compiled graphs call torchleaf::call/forward/backward without
    PyTorch's generic boxed entry (see csrc/python/operator_entries.cpp).
    Runs before anything hashes these OpOverloads: their hash is their
    `_op`'s."""
    for name in ("call", "forward", "backward"):
        overload = getattr(torch.ops.torchleaf, name).default
        overload._op = _C.direct_operator_entry(name, overload._op)


def _register_ops():
    _install_direct_entries()
    torch.library.register_fake("torchleaf::call", _fake_call)
    torch.library.register_fake("torchleaf::forward", _fake_forward)
    torch.library.register_fake("torchleaf::call_mutating", _fake_call_mutating)
    torch.library.register_fake("torchleaf::forward_mutating", _fake_forward_mutating)
    torch.library.register_fake("torchleaf::call_functional", _fake_call_functional)
    torch.library.register_fake("torchleaf::forward_functional", _fake_forward_functional)
    torch.library.register_fake("torchleaf::backward", _fake_backward)
    torch.library.register_fake("torchleaf::stack_handles", _fake_stack_handles)
    torch.library.register_fake("torchleaf::check_carried_int", _fake_check_carried_int)
    torch.library.register_fake("torchleaf::check_output_sizes", _fake_check_output_sizes)
    # Operators that run user code are never dead code (FX and Inductor keep
    # impure operators). Python leaves' compiled calls are ordered by the
    # token they thread (_leaf._ORDER_TOKEN), a data dependency that costs
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


# Activation checkpointing's pack hooks (torch.utils.checkpoint, non-reentrant):
# the first saves nothing (the region is recomputed in backward), the second
# saves the recomputed tensor itself.
_CHECKPOINT_PACK_HOOKS = frozenset({
    "_checkpoint_hook.__init__.<locals>.pack_hook",
    "_recomputation_hook.__init__.<locals>.pack_hook",
})


def _saved_hook_may_copy(pack_hook):
    """Whether the saved-tensor pack hook `pack_hook` may save a copy of a
    state handle, for which the core must keep the state until a backward
    consumes it. Checkpointing's never does: a state kept under it would
    never be consumed (backward replays the recomputation's state), one per
    step, with the body's saved activations. Other hooks (save_on_cpu, user
    hooks) may."""
    fn = inspect.unwrap(pack_hook)  # (the recomputation's is wrapped by torch._dynamo.disable)
    return not (
        getattr(fn, "__module__", None) == "torch.utils.checkpoint"
        and getattr(fn, "__qualname__", None) in _CHECKPOINT_PACK_HOOKS
    )


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
    rng_prims = torch._prims.rng_prims
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

    get_device._torchleaf = True
    rng_prims.get_device = get_device


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
    torch.library.register_fake(name, fake)
    if not mutating:
        _register_effectful_op(named_op(name).default, _EffectType.ORDERED)
    return True


def sync_cpp_leaves():
    """Register fakes and effects for C++ leaves defined since the last sync
    (call after loading a library that defines leaves)."""
    for leaf_id, name, mutable in _C.named_leaves():

        def fake(inputs, mutated=(), _id=leaf_id):
            return _C.run_fake(_id, 0, list(inputs), list(mutated), _strides_relied_on())

        if _register_named(name, fake, bool(mutable)):
            _functorch.register_named_rule(name, bool(mutable))


def register_named_python_leaf(name, mutating, fake):
    """Register the fake and effect of a named Python leaf's operator, once
    per name (the operator outlives its leaf, and a leaf defined again under
    the same name binds to it); returns its OpOverloadPacket."""
    _register_named(name, fake, mutating)
    return named_op(name)
