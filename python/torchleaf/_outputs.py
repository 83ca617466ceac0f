"""Output descriptions: what a leaf call returned, as tensors plus a small
nested tuple of constants that says how to rebuild it.

Eager calls describe what the real function returned; traced calls record
what the fake returned (the graph keeps it) and check each real call's
description against it, since a compiled graph can only return the traced
structure and constants. The same code encodes (real and fake outputs) and
decodes (eager and compiled callers).
"""

import collections
import functools
import itertools
from typing import Any

import torch

from . import _carriers as carriers
from ._errors import LeafFunctionError, function_name
from ._live_leaves import leaf_of
from ._torch_private import assume_constant_result, pytree, statically_known_true

_Tensor = torch.Tensor
_CHECK_CARRIED_INT = torch.ops.torchleaf.check_carried_int.default
_CHECK_OUTPUT_SIZES = torch.ops.torchleaf.check_output_sizes.default

# Outputs are described by a small nested tuple of constants, so that Dynamo
# can rebuild them from a constant (it cannot use a TreeSpec constant), and
# an eager call builds one per call at the cost of tuple displays (a record
# class would cost each call ~0.3 us per node). The forms, by kind (index 0):
#
#   (_OUT_TENSOR, i)                        operator output i
#   (_OUT_INT, i, coding)                   an int carried by output i
#   (_OUT_CONST, value)                     a constant
#   (_OUT_TUPLE, children) (_OUT_LIST, children)
#   (_OUT_DICT, keys, children)
#   (_OUT_NAMEDTUPLE, cls, children, key)
#   (_OUT_TYPED_TUPLE, cls, children, key, build)
#   (_OUT_TYPED_DICT, keys, children, key, build)
#
# where `key` names the type in the leaf's _output_types table (compiled
# code builds from the table: Dynamo cannot call a class out of a constant).
_OUT_TENSOR, _OUT_TUPLE, _OUT_LIST, _OUT_DICT, _OUT_CONST, _OUT_NAMEDTUPLE = range(6)
# A tuple or dict of a type of its own (a structseq such as torch.max's
# result, torch.Size, OrderedDict, defaultdict, a dict subclass): rebuilt
# as that type from the leaf's table (_output_types).
_OUT_TYPED_TUPLE, _OUT_TYPED_DICT = 6, 7
# An int output that a traced graph cannot hold as a constant: the fake
# returned a SymInt (a size of a dynamic input, an unbacked size), so each
# call's int travels as the size of a zero-stride int64 carrier among the
# operator's outputs, as int arguments do: (_OUT_INT, tensor index, coding),
# coding carriers.SIZE (the int is the size: known non-negative without a
# guard) or carriers.ZIGZAG. Once a trace of a call structure carried an
# int, its later traces carry it with that coding.
_OUT_INT = 8
SINGLE = (_OUT_TENSOR, 0)


def _type_key(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _rebuilt_exactly(obj, cls, base):
    """Whether output container `obj` (a subclass of tuple or dict) is
    rebuilt as it was by calling its type on its items, eager and compiled
    alike: a structseq or torch.Size; an OrderedDict; a defaultdict whose
    factory its name names (a class or a module-level function, not a
    lambda or closure made per call); a subclass that keeps its base's
    constructor and has no attributes of its own. Others (a Counter, a
    constructor of its own) are returned as a plain tuple or dict."""
    if cls is collections.OrderedDict or cls is torch.Size or hasattr(cls, "n_fields"):
        return True
    if cls is collections.defaultdict:
        factory = obj.default_factory
        name = getattr(factory, "__qualname__", "")
        return factory is None or isinstance(factory, type) or (
            "<locals>" not in name and "<lambda>" not in name and getattr(factory, "__closure__", None) is None
        )
    return (
        cls.__new__ is base.__new__
        and cls.__init__ is base.__init__
        and not getattr(obj, "__dict__", None)
    )


def _children(desc):
    """A container description's child descriptions."""
    kind = desc[0]
    return desc[1] if kind == _OUT_TUPLE or kind == _OUT_LIST else desc[2]


def _traced_children(traced, kind, n, keys=None):
    """The traced description's children, where it describes a container of
    `kind` (a kind of `_encode`'s containers) with `n` of them (and, for a
    dict, these `keys`); else None."""
    if traced is None or traced[0] != kind or (keys is not None and traced[1] != keys):
        return None
    children = _children(traced)
    return children if len(children) == n else None


def _encode_all(leaf, values, tensors, subs):
    """_encode of each of `values`, with its traced description from `subs`
    (_traced_children) where there is one."""
    if subs is None:
        return tuple(_encode(leaf, x, tensors) for x in values)
    return tuple(_encode(leaf, x, tensors, t) for x, t in zip(values, subs))


def _encode(leaf, obj, tensors, traced=None):
    """The description of output `obj`, its tensors appended to `tensors`.
    With `traced` (the traced call's description), the ints where the fake
    returned a SymInt become carriers (_OUT_INT)."""
    if isinstance(obj, _Tensor):
        tensors.append(obj)
        return (_OUT_TENSOR, len(tensors) - 1)
    if isinstance(obj, torch.SymInt):  # a fake's
        if traced is not None and traced[0] == _OUT_INT:
            coding = traced[2]  # as the call structure's earlier traces
        else:
            # A size or an unbacked count (a bare symbol known non-negative):
            # the size itself, which binds an unbacked symbol. Any other
            # expression is zigzag-coded, even one the trace knows is
            # non-negative: it knows so from dynamic sizes >= 2 (s0 - 2), and
            # later traces of the call structure, which keep this coding,
            # may specialize a size to 0 or 1.
            coding = carriers.SIZE if obj.node.expr.is_Symbol and statically_known_true(obj >= 0) else carriers.ZIGZAG
        tensors.append(carriers.output_carrier(leaf._name, obj, coding))
        return (_OUT_INT, len(tensors) - 1, coding)
    if traced is not None and traced[0] == _OUT_INT and type(obj) is int:
        tensors.append(carriers.output_carrier(leaf._name, obj, traced[2]))
        return (_OUT_INT, len(tensors) - 1, traced[2])
    if isinstance(obj, tuple):
        cls: Any = type(obj)
        if cls is not tuple and not hasattr(obj, "_fields") and not _rebuilt_exactly(obj, cls, tuple):
            cls = tuple  # returned as a plain tuple
        kind = _OUT_TUPLE if cls is tuple else _OUT_NAMEDTUPLE if hasattr(obj, "_fields") else _OUT_TYPED_TUPLE
        children = _encode_all(leaf, obj, tensors, _traced_children(traced, kind, len(obj)))
        if cls is tuple:
            return (_OUT_TUPLE, children)
        key = _type_key(cls)
        # Compiled code builds it from the leaf's own table (Dynamo cannot
        # call a class that came out of a constant); eager calls from the
        # description. Entries never change once set: compiled code is
        # guarded on them.
        leaf._output_types.setdefault(key, cls)
        if hasattr(obj, "_fields"):
            return (_OUT_NAMEDTUPLE, cls, children, key)
        return (_OUT_TYPED_TUPLE, cls, children, key, cls)  # built from one sequence
    if isinstance(obj, list):
        return (_OUT_LIST, _encode_all(leaf, obj, tensors, _traced_children(traced, _OUT_LIST, len(obj))))
    if isinstance(obj, dict):
        cls = type(obj)  # (any type)
        if cls is not dict and not _rebuilt_exactly(obj, cls, dict):
            cls = dict  # returned as a plain dict
        keys = tuple(obj.keys())
        kind = _OUT_DICT if cls is dict else _OUT_TYPED_DICT
        children = _encode_all(leaf, obj.values(), tensors, _traced_children(traced, kind, len(keys), keys))
        if cls is dict:
            return (_OUT_DICT, keys, children)
        if cls is collections.defaultdict:
            # By the factory's name, which names one factory (_rebuilt_exactly).
            factory = obj.default_factory  # type: ignore[attr-defined]
            key = f"collections.defaultdict({function_name(factory) if factory is not None else None})"
            build: Any = functools.partial(collections.defaultdict, factory)
        else:
            key, build = _type_key(cls), cls
        leaf._output_types.setdefault(key, build)
        return (_OUT_TYPED_DICT, keys, children, key, build)
    node = pytree.SUPPORTED_NODES.get(type(obj))
    if node is not None:
        # Another registered pytree node (a registered dataclass, a deque):
        # its children, rebuilt by its unflatten function with this context.
        values, context = node.flatten_fn(obj)
        cls = type(obj)
        key = f"{_type_key(cls)} with context {context!r}"
        build = leaf._output_types.get(key)
        if build is None:
            build = leaf._output_types[key] = _rebuilder(node.unflatten_fn, context)
        children = _encode_all(leaf, values, tensors, _traced_children(traced, _OUT_TYPED_TUPLE, len(values)))
        return (_OUT_TYPED_TUPLE, cls, children, key, build)
    return (_OUT_CONST, obj)


def _rebuilder(unflatten, context):
    return lambda values: unflatten(values, context)


def decode(desc, tensors, types=None):
    """The output `desc` describes, from its tensors; `types` (compiled
    code) is the leaf's _output_types, from which typed containers are
    built, else from the description."""
    kind = desc[0]
    if kind == _OUT_TENSOR:
        return tensors[desc[1]]
    if kind == _OUT_TUPLE:
        return tuple(decode(d, tensors, types) for d in desc[1])
    if kind == _OUT_LIST:
        return [decode(d, tensors, types) for d in desc[1]]
    if kind == _OUT_DICT:
        return dict(zip(desc[1], [decode(d, tensors, types) for d in desc[2]]))
    if kind == _OUT_NAMEDTUPLE:
        cls = desc[1] if types is None else types[desc[3]]
        return cls(*[decode(d, tensors, types) for d in desc[2]])
    if kind == _OUT_TYPED_TUPLE:
        build = desc[4] if types is None else types[desc[3]]
        return build([decode(d, tensors, types) for d in desc[2]])
    if kind == _OUT_TYPED_DICT:
        build = desc[4] if types is None else types[desc[3]]
        return build(zip(desc[1], [decode(d, tensors, types) for d in desc[2]]))
    if kind == _OUT_INT:
        return carriers.decode(tensors[desc[1]].shape[0], desc[2])
    return desc[1]


def structure_of(desc, carried_as_int=False):
    """The shape of a description without constant values (for validation);
    with `carried_as_int`, an int carried as a size has an int constant's
    (traces of one call structure differ so when one specialized a size)."""
    kind = desc[0]
    if kind == _OUT_INT:
        return (_OUT_CONST, int) if carried_as_int else kind
    if kind == _OUT_TENSOR:
        return kind
    if kind == _OUT_CONST:
        return (kind, type(desc[1]))
    children = (structure_of(d, carried_as_int) for d in desc[2 if kind in _KEYED_KINDS else 1])
    if kind == _OUT_DICT:
        return (kind, desc[1], tuple(children))
    if kind == _OUT_NAMEDTUPLE or kind == _OUT_TYPED_TUPLE:
        return (kind, desc[3], tuple(children))
    if kind == _OUT_TYPED_DICT:
        return (kind, desc[3], desc[1], tuple(children))
    return (kind, tuple(children))


# Description kinds whose children are desc[2] (else desc[1]).
_KEYED_KINDS = (_OUT_DICT, _OUT_NAMEDTUPLE, _OUT_TYPED_TUPLE, _OUT_TYPED_DICT)


def constants(desc, path="output"):
    """(path, value) for every constant in a description."""
    kind = desc[0]
    if kind == _OUT_CONST:
        yield path, desc[1]
    elif kind == _OUT_DICT or kind == _OUT_TYPED_DICT:
        for key, d in zip(desc[1], desc[2]):
            yield from constants(d, f"{path}[{key!r}]")
    elif kind == _OUT_NAMEDTUPLE:
        for name, d in zip(desc[1]._fields, desc[2]):
            yield from constants(d, f"{path}.{name}")
    elif kind == _OUT_TYPED_TUPLE:
        for i, d in enumerate(desc[2]):
            yield from constants(d, f"{path}[{i}]")
    elif kind != _OUT_TENSOR and kind != _OUT_INT:
        for i, d in enumerate(desc[1]):
            yield from constants(d, f"{path}[{i}]")


def flatten_output(leaf, out, traced=None):
    if isinstance(out, _Tensor):  # fake tensors too: one description object
        return [out], SINGLE
    tensors: list = []
    return tensors, _encode(leaf, out, tensors, traced)


def _operator_outputs(desc):
    """The _OUT_TENSOR and _OUT_INT descriptions in `desc`: each an
    operator output."""
    kind = desc[0]
    if kind == _OUT_TENSOR or kind == _OUT_INT:
        yield desc
    elif kind != _OUT_CONST:
        for child in _children(desc):
            yield from _operator_outputs(child)


def has_int_carriers(desc):
    return any(d[0] == _OUT_INT for d in _operator_outputs(desc))


def output_checks(desc, flat):
    """What traced code checks of a call's real outputs (check_traced_outputs),
    from the fake's: (index, zigzag) for each int carried as a size, (index,
    None) for each tensor output with a symbolic size. Static sizes are
    checked inside the leaf's operator (output_check.h)."""
    checks = []
    for d in _operator_outputs(desc):
        if d[0] == _OUT_INT:
            checks.append((d[1], d[2] == carriers.ZIGZAG))
        elif any(isinstance(s, torch.SymInt) for s in flat[d[1]].shape):
            checks.append((d[1], None))
    return tuple(checks)


def check_traced_outputs(leaf, checks, outputs):
    """In traced code, check what the graph takes from the fake against the
    real outputs (output_checks). The graph computes a carried int or a
    symbolic size from its inputs' sizes, as the fake's expression says, and
    uses it downstream in place of the real one, so a fake with a wrong
    expression would silently give the call's results its own ints and
    sizes. The check operators compare the two when the graph runs
    (operators with a side effect: never dead code)."""
    for index, zigzag in checks:
        t = outputs[index]
        if zigzag is None:
            _CHECK_OUTPUT_SIZES(leaf._name, index, t, t.shape)
        else:
            _CHECK_CARRIED_INT(leaf._name, t, t.shape[0], zigzag)


def _show(desc):
    kind = desc[0]
    if kind == _OUT_TENSOR:
        return "Tensor"
    if kind == _OUT_INT:
        return "int"
    if kind == _OUT_CONST:
        return repr(desc[1])
    if kind == _OUT_DICT or kind == _OUT_TYPED_DICT:
        items = "{" + ", ".join(f"{k!r}: {_show(d)}" for k, d in zip(desc[1], desc[2])) + "}"
        return items if kind == _OUT_DICT else f"{desc[3]}({items})"
    if kind == _OUT_NAMEDTUPLE or kind == _OUT_TYPED_TUPLE:
        return desc[1].__name__ + "(" + ", ".join(_show(d) for d in desc[2]) + ")"
    inner = ", ".join(_show(d) for d in desc[1])
    return f"({inner})" if kind == _OUT_TUPLE else f"[{inner}]"


def _typed_keys(desc):
    """The keys of a description's typed containers, depth first: what
    tells containers apart that _show prints alike (a deque's maxlen, a
    registered node's context)."""
    kind = desc[0]
    if kind == _OUT_TENSOR or kind == _OUT_INT or kind == _OUT_CONST:
        return
    if kind in (_OUT_NAMEDTUPLE, _OUT_TYPED_TUPLE, _OUT_TYPED_DICT):
        yield desc[3]
    for d in _children(desc):
        yield from _typed_keys(d)


def structure_mismatch(leaf, real, fake):
    real_text, fake_text = _show(real), _show(fake)
    if real_text == fake_text:
        for r, f in itertools.zip_longest(_typed_keys(real), _typed_keys(fake)):
            if r != f:
                real_text, fake_text = f"{real_text}: {r}", f"{fake_text}: {f}"
                break
    return LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' returned a different output structure than "
        f"its fake implementation.\n  real: {real_text}\n  fake: {fake_text}\n"
        f"Make the fake return the same pytree structure as the real function."
    )


def fake_structure_varied(leaf, earlier, later):
    return LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' has a fake implementation that returned two "
        f"output structures for one call structure:\n  {_show(earlier)}\n  {_show(later)}\n"
        f"A compiled graph keeps the structure its trace saw, so a call could return the other "
        f"one's. The fake must depend only on its arguments: it runs on any module of a module "
        f"argument's structure, so pass a setting it reads from the module (such as "
        f"self.training) as an argument of the leaf."
    )


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def check_fake_constants(leaf, desc):
    """A fake's non-tensor outputs become graph constants: only plain values."""
    for path, value in constants(desc):
        if not isinstance(value, _CONSTANT_TYPES):
            if isinstance(value, (torch.SymBool, torch.SymFloat)):
                raise LeafFunctionError(
                    f"torchleaf: the fake implementation of leaf function '{leaf._name}' returned a "
                    f"{type(value).__name__} as {path}: a bool or float computed from symbolic "
                    f"sizes, which a compiled graph cannot hold as a constant. Return it as a 0-d "
                    f"tensor from both the function and the fake (torch.tensor(...) in the "
                    f"function, torch.empty((), dtype=...) in the fake), or compute it outside the "
                    f"leaf from the inputs' sizes."
                )
            raise LeafFunctionError(
                f"torchleaf: the fake implementation of leaf function '{leaf._name}' returned a "
                f"{type(value).__name__} where a tensor or a plain constant (None, bool, int, "
                f"float, str) was expected. Return tensors (e.g. torch.empty(...)) for array outputs."
            )


def _same_constant(a, b):
    """a == b, with nan equal to nan (in each part of a complex)."""
    if type(a) is complex:
        return _same_constant(a.real, b.real) and _same_constant(a.imag, b.imag)
    return a == b or (type(a) is float and a != a and b != b)


def check_graph_constants(leaf, traced, real, from_real=False):
    """A graph returns the constants its fake returned when it was traced; a
    real call that returns other values would be silently wrong. So does a
    call through the operator that no fake described (a dispatch mode, a
    torch.func transform): its caller gets the first such call's constants."""
    for (path, fake_value), (_, real_value) in zip(constants(traced), constants(real)):
        if type(fake_value) is type(real_value) and _same_constant(fake_value, real_value):
            continue
        if from_real:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' returned {real_value!r} at {path}, but "
                f"{fake_value!r} there on its first call of this structure through the operator (under "
                f"a dispatch mode or a torch.func transform), whose outputs carry tensors only: the "
                f"caller gets the first call's non-tensor outputs. Return the value as a tensor."
            )
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' returned {real_value!r} at {path}, but "
            f"its fake implementation returned {fake_value!r} there when the graph was traced, "
            f"and a compiled graph can only return the traced constant. Return the value as a "
            f"tensor, or make the fake return the same constant."
        )



@assume_constant_result
def traced_output(leaf, plan_index):
    """(output description, checks) of a traced call, where `checks` is what
    traced code checks of its real outputs (output_checks, read right after
    this trace ran the fake); None for a single tensor with static sizes,
    which traced code returns as it is (no guards on decode or the checks).
    A constant of the graph: called by Dynamo at trace time."""
    plan = leaf_of(leaf)._plans[plan_index]
    if plan.out is SINGLE and not plan.out_checks:
        return None
    return plan.out, plan.out_checks


def traced_result(leaf, traced, outputs):
    """What a compiled or exported call returns, from its operator's outputs
    (a compiled call's order token last, which no description names) and
    ``traced_output``'s answer: the traced description's outputs, checked
    where the graph takes ints or sizes from the fake (check_traced_outputs).
    Traced by Dynamo.

    Callers call ``traced_output`` themselves, and this only where it is not
    None: Dynamo guards every global a traced function reads on each step,
    and the common single tensor then reads none of this module's."""
    desc, checks = traced
    if checks:
        check_traced_outputs(leaf, checks, outputs)
    return decode(desc, outputs, leaf._output_types)
