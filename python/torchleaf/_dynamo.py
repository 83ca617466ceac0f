"""Compiled calls: what Dynamo traces when a leaf is called inside
torch.compile, and the trace-time bookkeeping it bakes into graphs.

Traced code runs on every call of a compiled frame only as the guards Dynamo
derives from it: each global and attribute read here is a guard checked per
step. So everything that can be decided at trace time is decided by
functions Dynamo calls for their constant result (assume_constant_result),
and the traced code itself reads few names. Everything but the tensors
(module tensors and handles included) and carried ints and floats becomes a
graph constant.
"""

import functools
import math
import operator
import sys
import weakref

import torch
from torch import nn

from . import _carriers as carriers
from . import _export
from ._classify import (
    COMPILED,
    CONSTANT_ARG,
    FLOAT_ARG,
    INT_ARG,
    ITERATOR_ARG,
    MODULE_ARG,
    NDARRAY_ARG,
    TENSOR_ARG,
    classify,
    plain,
)
from ._errors import LeafFunctionError
from ._live_leaves import leaf_of
from ._module_index import note_class
from ._modules import HANDLE_ATTR, ModuleHandle, ModuleStructure, module_state, sight_module
from ._outputs import traced_output, traced_result
from ._plans import (
    BY_HANDLE,
    FLOAT,
    IN_FLOAT,
    IN_NDARRAY,
    IN_TENSOR,
    INT_BY_CODING,
    MODULE_KEY,
    MODULE_KINDS,
    NDARRAY,
    SHARED_MODULE_KEY,
    TENSOR,
    split_module_tensors,
)
from ._runner import autocast_state
from ._torch_private import (
    CONSTANT_FUNCTIONS_TAKE_OBJECTS,
    assume_constant_result,
    current_dynamo_output_graph,
    dynamo_traces_a_subgraph,
    functorch,
    is_exporting,
    pytree,
)

_Tensor = torch.Tensor
_MODULE = "\x00torchleaf:module"  # stands for a module in a compiled call's skeleton
_SHARED_MODULE = "\x00torchleaf:shared-module"  # ... a shallow copy's (see compiled_call)

# The order token of compiled calls: each call of a graph after the first
# takes the one the previous call returned, and the last one is stored back
# here when the graph has run. Read as a graph input only by a graph's first
# call that mutates, and inside higher-order operators' bodies. No data.
_ORDER_TOKEN = torch.empty(0, dtype=torch.int64)

# Dynamo guards each global that traced code reads, and each attribute on
# the way, on every call of a compiled frame: one global each instead of
# torch.compiler.is_exporting's chain and torch.ops.torchleaf.call's four.
_is_exporting = is_exporting
_CALL = torch.ops.torchleaf.call.default
_CALL_MUTATING = torch.ops.torchleaf.call_mutating.default


def _aliases(a, b):
    """Whether two tensors are one tensor or views of one base (also under
    Dynamo, which cannot compare storages but knows bases)."""
    return a is b or a._base is b or b._base is a or (a._base is not None and a._base is b._base)


def check_read_and_mutated(leaf, flat, slots, mutated_positions, plan_index):
    """A tensor passed both read-only and as a declared-mutable argument: the
    read-only one would see the mutation eagerly (where the core reports it
    as undeclared) but not in a compiled graph, which mutates a copy."""
    for m in mutated_positions:
        for kind, pos, *_ in slots:  # (Slots, or _intern_for_compile's tuples)
            if kind == IN_TENSOR and _aliases(flat[pos], flat[m]):
                _refuse_read_and_mutated(leaf, plan_index, pos, m)


@assume_constant_result  # raises at trace time
def _refuse_read_and_mutated(leaf, plan_index, read, mutated):
    leaf = leaf_of(leaf)
    spec = leaf._plans[plan_index].spec
    read, mutated = leaf._signature.argument_at(spec, read), leaf._signature.argument_at(spec, mutated)
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' got the same tensor (or views of one tensor) as "
        f"argument {read}, which it reads, and as argument {mutated}, which it mutates in place "
        f"(mutates_args). Pass a clone as the read-only argument (x.clone()), or pass the "
        f"tensor only once."
    )


# Why a compiled call cannot take an argument, by its kind, for
# _refuse_compiled_argument.
_COMPILED_REFUSALS = {
    "fsdp": "that fully_shard was applied to, in a compiled call: FSDP's gradient hooks for "
    "that module's own parameters do not see the leaf's use of them, which would leave them "
    "without a gradient. Shard only a parent of the module (fully_shard(model)), or call the "
    "leaf outside the compiled region (eager calls with module.unshard() before them work).",
    "iterator": "in a compiled call: the compiler consumes an iterator while it traces, so the "
    "function could not iterate over it when the graph runs. Pass a list or a tuple "
    "(list(it)), or call the leaf outside the compiled region.",
}

@assume_constant_result  # raises at trace time
def _refuse_compiled_argument(leaf, kind, type_name):
    leaf = leaf_of(leaf)
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' got a {type_name} argument {_COMPILED_REFUSALS[kind]}"
    )


@assume_constant_result
def _sharded_on_its_own(cls):
    """Whether fully_shard was applied to modules of class ``cls`` (FSDP2
    makes each such module's class a subclass of FSDPModule). Looked up, not
    imported (an import where nothing loaded FSDP yet takes ~0.5 s): no
    module is sharded before FSDP is loaded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and issubclass(cls, fsdp.FSDPModule)


# ---------------------------------------------------------------- compilation
_OBJECT = "\x00torchleaf:object"  # (_OBJECT, i): the i-th object passed beside a skeleton
_NODE = "\x00torchleaf:node"  # tags a pytree node in a compiled call's skeleton
_OPAQUE = "\x00torchleaf:opaque"  # stands for a node context Dynamo cannot pass


def _nest(spec, leaves):
    """Traced by Dynamo: the call's structure as nested tuples of builtins,
    (_NODE, node type, context, children) per pytree node, ``leaves`` at the
    leaves. Dynamo cannot pass a TreeSpec, nor a user object (a registered
    dataclass) rebuilt around markers, to an assume_constant_result function."""
    if spec.is_leaf():
        return next(leaves)
    context = spec.context
    if spec.type not in (tuple, list, dict) and not plain(context):
        context = _OPAQUE  # _intern_for_compile explains
    return (_NODE, spec.type, context, tuple(_nest(c, leaves) for c in spec.children()))


_LEAF = "\x00torchleaf:leaf"  # a leaf's place in _flatten_traced's structure


def _flatten_traced(obj, flat):
    """Traced by Dynamo: pytree.tree_flatten of a call's arguments, appending
    the leaves to ``flat`` and returning the structure as _nest does, with
    _LEAF at the leaves. Builtin containers are walked here: tracing pytree's
    own code would guard the compiled frame on pytree internals, with guards
    that run in Python on every call. Other pytree nodes go through pytree."""
    # (Tensors first: type() of a tensor compared with a class would add a
    # guard run in Python, on torch.Tensor's identity.)
    if isinstance(obj, (_Tensor, nn.Module)) or obj is None:
        flat.append(obj)
        return _LEAF
    t = type(obj)
    if t is tuple or t is list:
        return (_NODE, t, None, tuple(_flatten_traced(x, flat) for x in obj))
    if t is dict:
        return (_NODE, dict, list(obj.keys()), tuple(_flatten_traced(x, flat) for x in obj.values()))
    if t in (bool, int, float, str) or not (isinstance(obj, tuple) or t in pytree.SUPPORTED_NODES):
        flat.append(obj)  # a leaf for pytree too (namedtuples are tuples)
        return _LEAF
    leaves, spec = pytree.tree_flatten(obj)
    flat.extend(leaves)
    return _nest(spec, iter([_LEAF] * len(leaves)))


def _fill(nested, leaves):
    """A _flatten_traced structure with ``leaves`` in place of _LEAF."""
    if nested is _LEAF:
        return next(leaves)
    return (nested[0], nested[1], nested[2], tuple(_fill(c, leaves) for c in nested[3]))


def _unnest(leaf, nested, flat, skeleton, path=()):
    """The TreeSpec of a _nest result, appending its leaves to ``flat``."""
    if type(nested) is not tuple or len(nested) != 4 or nested[0] is not _NODE:
        flat.append(nested)
        return pytree.treespec_leaf()
    _, node_type, context, children = nested
    if context is _OPAQUE:
        # path: (0 for args or 1 for kwargs, index, ...) in the call's (args, kwargs)
        which = f"positional argument {path[1]}" if path[0] == 0 else f"argument {skeleton[3][1][2][path[1]]!r}"
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' got a {getattr(node_type, '__name__', node_type)} "
            f"in {which} under torch.compile, a pytree node whose context (the second result of "
            f"its flatten function) is not made of plain constants (None, bool, int, float, str, "
            f"types, and tuples or lists of them), so a compiled graph cannot keep its structure. "
            f"Register the type with a context of plain constants (pytree.register_dataclass "
            f"does), or pass its tensors and constants as separate arguments."
        )
    return pytree.TreeSpec(
        node_type, context, [_unnest(leaf, c, flat, skeleton, path + (i,)) for i, c in enumerate(children)]
    )


@assume_constant_result
def _intern_for_compile(leaf, skeleton, structures, *objects):
    """Called by Dynamo at trace time only; its result is a graph constant
    (the leaf id among it: reading ``leaf._id`` in the trace would guard on it).
    ``skeleton``: the call's structure from _nest, with TENSOR, _MODULE (or
    _SHARED_MODULE) and the int markers at the leaves; ``structures``: (class,
    names, aliases, n_params) per module; ``objects``:
    one per (_OBJECT, index) leaf."""
    leaf = leaf_of(leaf)
    flat: list = []
    spec = _unnest(leaf, skeleton, flat, skeleton)
    modules = []
    for cls, *state in structures:
        note_class(cls)
        modules.append(ModuleStructure(cls.__module__, cls.__qualname__, *state))
    modules_in_order = iter(modules)
    key = tuple(
        (MODULE_KEY, next(modules_in_order)) if x is _MODULE
        else (SHARED_MODULE_KEY, next(modules_in_order)) if x is _SHARED_MODULE
        else objects[x[1]] if type(x) is tuple and len(x) == 2 and x[0] is _OBJECT
        else x
        for x in flat
    )
    for obj in objects:
        try:
            hash(obj)
        except TypeError:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' got an argument of type "
                f"{type(obj).__name__}, which is not hashable, in a compiled call: a compiled "
                f"graph keeps non-tensor arguments as constants. Pass it as a tensor (e.g. "
                f"torch.as_tensor(x)) or make it hashable."
            ) from None
    # The autocast state and the grad mode here, at trace time, are the
    # call's: Dynamo enters the traced code's autocast and grad mode contexts
    # for real while tracing, and guards the compiled code on the ambient ones.
    plan = leaf._plans.from_key(spec, key, COMPILED, autocast_state(), torch.is_grad_enabled())
    # Plain tuples: traced code reads them (a NamedTuple's attributes would
    # be traced too).
    slots = tuple((slot.kind, slot.position, slot.width, slot.coding) for slot in plan.slots)
    return leaf._id, plan.index, slots, plan.mutated


@assume_constant_result
def _positional_call_site(leaf, n):
    """Everything a compiled ``leaf(t1, ..., tn)`` with tensors only needs to
    know at trace time, as one graph constant: (leaf id, plan index, whether
    it takes the order token, whether it stores its own), or None when the
    call takes the general path (declared mutations, export). Dynamo guards
    every global and attribute that traced code reads, on every call of the
    compiled frame; one constant function, and no pytree call or leaf
    attribute read in traced code, keep those guards few."""
    leaf = leaf_of(leaf)
    if leaf._signature.mutates_args or is_exporting():
        return None
    plan = _positional_plan(leaf, n)
    return (leaf._id, plan.index, *_order_decisions(False))


@assume_constant_result
def _order_decisions(mutates):
    """(whether the compiled call Dynamo traces now takes the order token,
    whether it stores its own), see compiled_call."""
    first = _first_ordered_call()  # (also when mutating: it marks the trace)
    # Under a torch.func transform traced by Dynamo (grad, vjp, jacrev) the
    # returned token is wrapped at the transform's level; stored to a global
    # it would be a graph output AOTAutograd cannot read. Calls there are
    # ordered by the token they thread, as inside higher-order operators.
    stores = not _tracing_a_subgraph() and functorch.peek_interpreter_stack() is None
    return mutates or not first, stores


def _positional_plan(leaf, n):
    """The compiled plan of ``leaf(t1, ..., tn)`` with tensors only."""
    spec = pytree.tree_structure((tuple(range(n)), {}))
    return leaf._plans.from_key(spec, (TENSOR,) * n, COMPILED, autocast_state(), torch.is_grad_enabled())


@assume_constant_result
def _tracing_a_subgraph():
    """Whether Dynamo is tracing the body of a higher-order operator now."""
    return dynamo_traces_a_subgraph()


# The Dynamo output graphs (one per trace) in which an ordered call was
# traced, by id, weakly (they are not hashable): trace-time bookkeeping,
# never read at run time.
_ORDERED_TRACES: dict[int, weakref.ref] = {}


def _forget_trace(key, _):
    _ORDERED_TRACES.pop(key, None)


@assume_constant_result
def _first_ordered_call():
    """Whether the compiled call Dynamo traces now is the first of its graph.
    Nothing earlier in the graph needs to run before it (graphs run one after
    another), so it takes no order token: reading ``_ORDER_TOKEN`` makes it a
    graph input with its guards, ~8k instructions on every step. Later calls
    of the graph take the token the previous one returned, a traced value."""
    graph = current_dynamo_output_graph()
    if graph is None:
        return False
    key = id(graph)
    seen = _ORDERED_TRACES.get(key)
    if seen is not None and seen() is graph:
        return False
    _ORDERED_TRACES[key] = weakref.ref(graph, functools.partial(_forget_trace, key))
    return True




def _specialized(x, kind):
    """A static argument's value as a constant, also where Dynamo made it
    symbolic (a second value marks a frame's scalar dynamic): Dynamo
    evaluates operator.index of a symbolic int, and math.frexp of a
    symbolic float, to constants it guards (an exact round trip)."""
    if kind == INT_ARG:
        return operator.index(x)
    return math.ldexp(*math.frexp(x))


def _count_leaves(nested):
    if nested is _LEAF:
        return 1
    return sum(_count_leaves(c) for c in nested[3])


@assume_constant_result
def _static_positions(leaf, nested):
    """The flat positions of a compiled call's arguments that the leaf's
    static_argnames name (``nested``: the call's _flatten_traced structure)."""
    leaf = leaf_of(leaf)
    if not leaf._signature.static_argnames:
        return ()
    args, kwargs = nested[3]
    # (A tuple: Dynamo cannot guard a frozenset constant's membership test.)
    return tuple(sorted(leaf._signature.static_positions(
        len(args[3]), list(kwargs[2]), [_count_leaves(c) for c in (*args[3], *kwargs[3])]
    )))


def _handle_tensor(x):
    """The handle input of a module that a compiled call names by a handle:
    its own handle's tensor (lifted as an input, as a parameter is), or a
    new handle's value as a constant (Dynamo then guards on the module)."""
    handle = x.__dict__.get(HANDLE_ATTR)
    if type(handle) is ModuleHandle and handle.owner() is x:
        return handle.tensor
    return torch.full((), sight_module(x), dtype=torch.int64)


def compiled_call(leaf, args, kwargs):
    """A leaf call traced by Dynamo: its operator, with everything but the
    call's tensors (module tensors and handles included) and carried ints
    and floats baked into the plan as constants."""
    global _ORDER_TOKEN
    # (The id where the release cannot pass the leaf; operator.index keeps
    # Dynamo from making an int attribute symbolic.)
    leaf_arg = leaf if CONSTANT_FUNCTIONS_TAKE_OBJECTS else operator.index(leaf._id)
    if not kwargs:
        n = 0  # (counted here: len() would be one more guarded global)
        for a in args:
            if not isinstance(a, _Tensor):
                break
            n += 1
        else:
            site = _positional_call_site(leaf_arg, n)
            if site is not None:
                # As below (see the order token there), without a pytree.
                leaf_id, plan_index, takes_token, stores_token = site
                inputs = [*args, _ORDER_TOKEN] if takes_token else [*args]
                outputs = _CALL(leaf_id, plan_index, inputs)
                if stores_token:
                    _ORDER_TOKEN = outputs[-1]
                traced = traced_output(leaf_arg, plan_index)
                return outputs[0] if traced is None else traced_result(leaf, traced, outputs)
    if _is_exporting():
        return _export.exported_call(leaf, *pytree.tree_flatten((args, kwargs)))
    flat: list = []
    nested = _flatten_traced((args, kwargs), flat)
    static = _static_positions(leaf_arg, nested)
    skeleton: list = []
    structures = []
    objects: list = []
    module_tensors = []
    modules = []
    for i, x in enumerate(flat):
        kind = classify(x, COMPILED)
        if kind == TENSOR_ARG:
            skeleton.append(TENSOR)
        elif static and kind in (INT_ARG, FLOAT_ARG) and i in static:
            skeleton.append(_specialized(x, kind))  # baked in: Dynamo guards its value
        elif kind == MODULE_ARG:
            cls = type(x)
            if _sharded_on_its_own(cls):
                _refuse_compiled_argument(leaf_arg, "fsdp", cls.__name__)
            names, aliases, n_params, tensors = module_state(x)
            # The graph finds the module by its tensors when it runs
            # (_module_index), so nothing here reads the module's identity:
            # one graph serves every module of the structure, fresh ones
            # included. A shallow copy (copy.copy) of a module torchleaf has
            # seen shares its tensors and its handle: it is named by a
            # handle of its own instead.
            handle = x.__dict__.get(HANDLE_ATTR)
            shared = type(handle) is ModuleHandle and handle.owner() is not x
            skeleton.append(_SHARED_MODULE if shared else _MODULE)
            # (A plain tuple: a ModuleStructure built in traced code would
            # be traced; _intern_for_compile makes it one.)
            structures.append((cls, names, aliases, n_params))
            module_tensors.append(tensors)
            modules.append(x)
        elif kind == INT_ARG:
            # May be symbolic: its value reaches the function through a
            # carrier's size instead of a graph constant (or stays a
            # constant beyond a size's range).
            coding = carriers.coding_of_argument(x)
            skeleton.append(x if coding is None else INT_BY_CODING[coding])
        elif kind == FLOAT_ARG:
            skeleton.append(FLOAT)
        elif kind == NDARRAY_ARG:
            skeleton.append(NDARRAY)
        elif kind == CONSTANT_ARG:
            skeleton.append(x)
        elif kind == ITERATOR_ARG:
            _refuse_compiled_argument(leaf_arg, "iterator", type(x).__name__)
        else:
            # Any other object (an enum, a config object): Dynamo passes it
            # to a constant function as an argument of its own (guarded on
            # its identity), not inside the skeleton.
            skeleton.append((_OBJECT, len(objects)))
            objects.append(x)
    leaf_id, plan_index, slots, mutated_positions = _intern_for_compile(
        leaf_arg, _fill(nested, iter(skeleton)), tuple(structures), *objects
    )
    if mutated_positions:
        check_read_and_mutated(leaf_arg, flat, slots, mutated_positions, plan_index)
    inputs = []
    mutable_buffers: list = []
    handles = []
    module_index = 0
    for kind, pos, width, coding in slots:
        if kind in MODULE_KINDS:
            split_module_tensors(width, module_tensors[module_index], inputs, mutable_buffers)
            if coding == BY_HANDLE:
                handles.append(_handle_tensor(modules[module_index]))
            module_index += 1
        elif kind == IN_TENSOR:
            inputs.append(flat[pos])
        elif kind == IN_NDARRAY:
            inputs.append(torch.as_tensor(flat[pos]))
        elif kind == IN_FLOAT:
            inputs.append(carriers.float_carrier(flat[pos]))
        else:  # IN_INT: a zero-stride carrier, no memory, its size the int's code
            inputs.append(carriers.input_carrier(flat[pos], coding))
    inputs.extend(handles)
    # Order: each compiled call takes the token the previous one returned,
    # and the last one's is stored back (a graph output), so calls run in
    # program order and none is dead code, whatever their outputs' use.
    # The first call of a graph takes none (_first_ordered_call), unless
    # it mutates: the token then comes before the mutated tensors, and
    # Plan.rebuild tells it only when it is the last input.
    # Inside a higher-order operator's body (activation checkpointing,
    # torch.cond) Dynamo refuses stores to outside state: there calls
    # take the token but return theirs unused, ordered by graph order.
    mutated = [flat[pos] for pos in mutated_positions] + mutable_buffers
    takes_token, stores_token = _order_decisions(len(mutated) != 0)  # (2.11 cannot trace bool(list))
    if takes_token:
        inputs.append(_ORDER_TOKEN)
    if mutated:
        outputs = _CALL_MUTATING(leaf_id, plan_index, inputs, mutated)
    else:
        outputs = _CALL(leaf_id, plan_index, inputs)
    if stores_token:
        _ORDER_TOKEN = outputs[-1]
    traced = traced_output(leaf_arg, plan_index)
    return outputs[0] if traced is None else traced_result(leaf, traced, outputs)
