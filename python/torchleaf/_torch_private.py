"""Every private PyTorch API torchleaf's Python package uses, in one place.

Private APIs carry no stability promise: each is a debt paid at every PyTorch
release. No other module of torchleaf imports a private PyTorch name; they
reach them here, so a release that moves one is fixed in this file (with a
switch on ``TORCH_VERSION`` where releases differ). docs/design.md's table
"Private PyTorch APIs" lists exactly the names in ``__all__`` (checked by
``tests/python/test_private_apis.py``, which also tests each name for the
behaviour torchleaf relies on).

Inductor's internals are reached through functions that import them on first
use: importing Inductor would cost every ``import torchleaf`` about a second.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch
import torch.utils._pytree as _pytree
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true
from torch.nn.utils.stateless import _reparametrize_module

#: The running release as (major, minor), for the switches below.
TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]

# ---------------------------------------------------------------- pytrees
#: torch.utils._pytree: tree_flatten/unflatten, TreeSpec (built directly for
#: a compiled call's structure), treespec_leaf, SUPPORTED_NODES (flatten and
#: unflatten functions of registered nodes, for outputs), treespec_dumps/loads
#: (exported calls), keystr/tree_flatten_with_path (argument names in errors),
#: _broadcast_to_and_flatten (a vmap rule's out_dims). torch.utils.pytree is
#: the public face, but may be backed by optree, whose specs Dynamo and export
#: do not take.
pytree = _pytree

# ---------------------------------------------------------------- Dynamo
#: A function Dynamo calls at trace time and whose result it bakes into the
#: graph as a constant (all of a compiled call's bookkeeping).
assume_constant_result: Callable[[Callable[..., Any]], Callable[..., Any]] = torch._dynamo.assume_constant_result


def current_dynamo_output_graph() -> Any:
    """The OutputGraph of the trace Dynamo runs now in this thread, or None."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return None if tx is None else tx.output


def dynamo_is_tracing() -> bool:
    """Whether this thread is inside a Dynamo trace (its TracingContext),
    also where Dynamo runs Python natively (a descriptor's __get__)."""
    return torch._guards.TracingContext.try_get() is not None


def dynamo_traces_a_subgraph() -> bool:
    """Whether Dynamo is tracing the body of a higher-order operator now
    (activation checkpointing, torch.cond): its tracer has a parent."""
    graph = current_dynamo_output_graph()
    return graph is not None and graph.current_tracer.parent is not None


#: Symbolic-shape queries that never add a guard (data-dependent ints).
guard_or_false = guard_or_false
statically_known_true = statically_known_true

# ---------------------------------------------------------------- modes
#: functorch's C++ module: peek_interpreter_stack, maybe_get_level,
#: is_batchedtensor, is_gradtrackingtensor, _unwrap_batched, _add_batch_dim,
#: _unwrap_for_grad, _wrap_for_grad (stacking per-sample state handles).
functorch: types.ModuleType = torch._C._functorch
#: Autocast state queries, cheaper than the public per-device ones.
is_any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
autocast_supported_devices: Callable[[], list] = torch._C._autocast_supported_devices
#: torch.set_grad_enabled without its context-manager object (~5k
#: instructions per call and back on a compiled step).
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled

# ---------------------------------------------------------------- modules
#: Runs a module with some parameters and buffers replaced by tensors, by
#: name (torch.func.functional_call's engine, with strict and tie_weights).
reparametrize_module = _reparametrize_module

# ---------------------------------------------------------------- operators
#: Marks an operator as having an ordered side effect (C++ leaves' named
#: operators: calls are neither reordered nor dead code).
register_effectful_op = _register_effectful_op
EffectType = _EffectType


#: Whether an OpOverload hashes by its ``_op`` (through 2.13), so that
#: replacing ``_op`` changes its hash: set_op_overload_entry must then run
#: before anything hashes the overload (has_side_effect's registry does).
#: From 2.14 it hashes by the dispatcher handle it was made with.
OP_OVERLOAD_HASHES_BY_OP: bool = TORCH_VERSION < (2, 14)


#: Whether Dynamo passes any object torchleaf hands an assume_constant_result
#: function (2.13 does). 2.11's refuses a LeafFunction that the trace did not
#: reach by a global name (a leaf compiled itself, one bound to an instance:
#: AsPythonConstantNotImplementedError); there such functions get its id.
CONSTANT_FUNCTIONS_TAKE_OBJECTS: bool = TORCH_VERSION >= (2, 13)

if TORCH_VERSION >= (2, 12):
    is_exporting = torch.compiler.is_exporting
else:

    def is_exporting() -> bool:
        """Whether torch.export traces now. Dynamo before 2.12 folds
        torch.compiler.is_exporting() to True in every trace, torch.compile's
        included (a compiled leaf call took the exported path and asked for
        an operator name); the flag it returns outside Dynamo is torch.export's
        alone, and Dynamo reads a module attribute as it is."""
        return torch.compiler._is_exporting_flag


def set_op_overload_entry(overload: Any, make_entry: Callable[[Any], Any]) -> None:
    """Replace the C++ callable an OpOverload calls (its ``_op``; every
    release calls it from ``__call__``) by ``make_entry(current)``. Where
    OP_OVERLOAD_HASHES_BY_OP, run it before anything hashes the overload."""
    overload._op = make_entry(overload._op)


def storage_weak_ref(tensor: torch.Tensor) -> Any:
    """A hashable weak reference to a tensor's storage (alias analysis of an
    FX graph's writes, for Inductor's lowerings)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


#: torch.utils.checkpoint's saved-tensor pack hooks (non-reentrant): the
#: first saves nothing (the region is recomputed in backward), the second the
#: recomputed tensor itself. Known by module and qualified name only.
CHECKPOINT_PACK_HOOKS = ("torch.utils.checkpoint", frozenset({
    "_checkpoint_hook.__init__.<locals>.pack_hook",
    "_recomputation_hook.__init__.<locals>.pack_hook",
}))

# ---------------------------------------------------------------- AOTAutograd


def rng_prims() -> types.ModuleType:
    """torch._prims.rng_prims: get_device, run_and_save_rng_state and
    run_with_rng_state (compiled activation checkpointing's RNG wrappers)."""
    return torch._prims.rng_prims


# ---------------------------------------------------------------- Inductor


def inductor_is_lowering() -> bool:
    """Whether Inductor is lowering a graph now (its virtualized graph
    handler is a GraphLowering); False until Inductor is imported."""
    graph = sys.modules.get("torch._inductor.graph")
    if graph is None:
        return False
    from torch._inductor.virtualized import _graph

    return isinstance(_graph._get_handler(check_poisoned=False), graph.GraphLowering)


def inductor_is_imported() -> bool:
    return "torch._inductor.lowering" in sys.modules


def inductor() -> types.SimpleNamespace:
    """Inductor's internals that torchleaf's lowerings use: ``ir``
    (FallbackKernel, MultiOutput and its skip_size_stride_alignment_checks),
    ``lowering`` (lowerings, make_fallback, tag_to_layout_constraint), ``V``
    (V.graph: operations, never_reuse_buffers, current_node, module,
    get_buffer, graph_inputs), ``get_layout_constraint_tag`` and
    ``PythonWrapperCodegen`` (codegen_input_size_asserts and its
    _pending_input_asserts)."""
    from torch._inductor import ir, lowering
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.virtualized import V
    from torch._library.utils import get_layout_constraint_tag

    return types.SimpleNamespace(
        ir=ir, lowering=lowering, V=V, get_layout_constraint_tag=get_layout_constraint_tag,
        PythonWrapperCodegen=PythonWrapperCodegen,
    )


__all__ = [
    "CHECKPOINT_PACK_HOOKS",
    "CONSTANT_FUNCTIONS_TAKE_OBJECTS",
    "EffectType",
    "OP_OVERLOAD_HASHES_BY_OP",
    "TORCH_VERSION",
    "assume_constant_result",
    "autocast_supported_devices",
    "current_dynamo_output_graph",
    "dynamo_is_tracing",
    "dynamo_traces_a_subgraph",
    "functorch",
    "guard_or_false",
    "inductor",
    "inductor_is_imported",
    "inductor_is_lowering",
    "is_any_autocast_enabled",
    "is_exporting",
    "pytree",
    "register_effectful_op",
    "reparametrize_module",
    "rng_prims",
    "set_grad_enabled",
    "set_op_overload_entry",
    "statically_known_true",
    "storage_weak_ref",
]
