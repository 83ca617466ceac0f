"""Inductor lowerings of torchleaf's operators.

Inductor lowers an operator without a lowering of its own to a fallback
kernel. For the operators whose kernel captures an autograd graph, that
fallback is wrapped so that buffers the captured graph may have saved are
never reused or written, and Inductor's size asserts of what the core
already guarantees are dropped. There is no public API for either
(docs/design.md, "Private PyTorch APIs"); everything private is reached
through _torch_private.
"""

import functools
import weakref
from typing import Any

import torch

from . import _torch_private as torch_private
from ._torch_private import inductor_is_imported

# The operators whose real kernel captures its body's autograd graph.
_CAPTURING_OPS = ("forward", "forward_mutating", "forward_functional")


def keep_captured_inputs():
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
    if _inductor_lowerings_installed or not inductor_is_imported():
        return
    _install_inductor_lowerings()


_inductor_lowerings_installed = False


def _install_inductor_lowerings():
    global _inductor_lowerings_installed
    inductor = torch_private.inductor()
    ir, lowering, V = inductor.ir, inductor.lowering, inductor.V
    get_layout_constraint_tag = inductor.get_layout_constraint_tag

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
            if op_at is None:
                _name_the_leaf_in_asserts(V.graph.operations[first:], ir, args[0] if args else None)
            for operation in V.graph.operations[first:]:
                if isinstance(operation, ir.FallbackKernel):
                    for buffer in operation.inputs:
                        try:
                            V.graph.never_reuse_buffers.add(buffer.get_name())
                        except (AttributeError, NotImplementedError):
                            pass  # not a buffer (a constant, an opaque object)
                elif op_at is None and (
                    _is_output(operation, ir, _STATE_HANDLE_INDEX) or _is_order_token(operation, ir)
                ):
                    _skip_size_check(operation)
            return result

        lowering.lowerings[target] = keep_inputs

    def check_call_outputs_as_the_leaf(target):
        """The lowering of a non-capturing call (call, call_mutating): its
        outputs' asserts name the leaf; its order token has none."""
        fallback = lowering.lowerings[target]

        @functools.wraps(fallback)
        def unchecked_token(*args, **kwargs):
            first = len(V.graph.operations)
            result = fallback(*args, **kwargs)
            _name_the_leaf_in_asserts(V.graph.operations[first:], ir, args[0] if args else None)
            for operation in V.graph.operations[first:]:
                if _is_order_token(operation, ir):
                    _skip_size_check(operation)
            return result

        lowering.lowerings[target] = unchecked_token

    def skip_checks_of_backward(target):
        fallback = lowering.lowerings[target]

        @functools.wraps(fallback)
        def unchecked_backward(*args, **kwargs):
            first = len(V.graph.operations)
            result = fallback(*args, **kwargs)
            for operation in V.graph.operations[first:]:
                if _is_output(operation, ir, None):
                    _skip_size_check(operation)
            state: Any = args[1] if len(args) > 1 else kwargs.get("state")
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
            carrier: Any = args[1] if len(args) > 1 else kwargs.get("carrier")
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
    codegen = inductor.PythonWrapperCodegen
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
    for op in (torch.ops.torchleaf.call.default, torch.ops.torchleaf.call_mutating.default):
        ensure_fallback(op)
        check_call_outputs_as_the_leaf(op)
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
    rng_prims = torch_private.rng_prims()
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


def _name_the_leaf_in_asserts(operations, ir, leaf_id):
    """Inductor asserts each output's size and stride as the fake gave them
    ("expected size 6==7 ... Error in op: <op> ... Use torch.library.opcheck"),
    where a fake is wrong only for some sizes (a symbolic expression that
    holds for even sizes only). The op it names is torchleaf's: the leaf
    and the fix are named instead."""
    if type(leaf_id) is not int:
        return
    from ._functorch import leaf_name

    label = (
        f"torchleaf leaf function '{leaf_name(leaf_id)}': its real function returned another size "
        f"or stride than its fake implementation (register_fake) gave for these inputs; fix the fake"
    )
    for operation in operations:
        if _is_output(operation, ir, None):
            operation.get_op_name = lambda label=label: label


def _is_order_token(operation, ir):
    """Whether `operation` takes a torchleaf operator's order token: its
    zero-size int64 output, which no kernel reads (from 2.14 Inductor
    asserts zero-size outputs too, on every step)."""
    if not _is_output(operation, ir, None):
        return False
    try:
        return operation.get_dtype() == torch.int64 and list(operation.get_size()) == [0]
    except (AttributeError, NotImplementedError):
        return False


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
_unchecked_graph_inputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# Per graph being lowered: each FX node's position, and for each storage the
# position of the last node that writes to it.
_graph_writes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _storage_of(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return torch_private.storage_weak_ref(val)


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
    V = torch_private.inductor().V
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


