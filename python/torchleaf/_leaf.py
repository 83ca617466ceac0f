"""The ``@leaf_function`` decorator: Python leaf functions on the C++ core.

Each :class:`LeafFunction` is one entry of the core (``torchleaf::call(leaf,
plan, inputs)``), removed when the LeafFunction dies. A call is flattened by
one piece of code, :meth:`LeafFunction._plan_for`, into the operator's tensors
and a :class:`_Plan` that says how to rebuild the user's arguments from them.
Plans belong to their leaf and are keyed by a deterministic description of the
call's structure (pytree spec, constants, module *structure*), never by object
identity; a graph names a plan by its index.

Calls come in two forms, sharing plans and the rebuild code:

* eager calls pass their own non-tensor arguments (constants, modules) along
  with the call, and receive the real function's output description back from
  it (``_C.call`` returns it): nothing travels through shared state;
* traced calls (make_fx, fake tensors, torch.compile) bake constants into the
  plan, and pass each nn.Module argument as its tensors plus a *handle tensor*
  that names the module at run time, so one graph serves every module of the
  same structure.
"""

import ast
import collections
import contextlib
import functools
import hashlib
import inspect
import itertools
import json
import operator
import os
import re
import sys
import threading
import types
import weakref

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true
from torch.nn.utils.stateless import _reparametrize_module

from . import _C, _functorch
from ._errors import LeafFunctionError

_Tensor = torch.Tensor
_Parameter = nn.Parameter

# ------------------------------------------------------------------ modules
# A module that torchleaf has seen carries a _ModuleHandle in its __dict__.
# Traced graphs take the handle's tensor as an input (Dynamo lifts it like a
# parameter, without guarding on the module's identity) and the real function
# looks the module up by the tensor's value when the graph runs. The table
# holds modules weakly.
_HANDLE_ATTR = "_torchleaf_handle"
_MODULES: dict = {}  # handle value -> weakref to the module
_MODULES_LOCK = threading.Lock()
_handle_values = itertools.count(1)
# Live modules by structure, for running fakes: a fake runs on fake tensors,
# whose handle values are unknown, so it sees a module of the same structure
# reparametrized with the call's own (fake) tensors.
_BY_STRUCTURE: dict = {}  # structure -> WeakSet of modules


class _ModuleHandle:
    """The value that names one module in traced graphs."""

    def __new__(cls, module, structure):
        if module is None:  # (also what pickles of older versions unpickle to)
            return _UNBOUND
        return super().__new__(cls)

    def __init__(self, module, structure):
        self.value = value = next(_handle_values)
        self.tensor = torch.tensor(value, dtype=torch.int64)
        self.view = None  # the module's _ModuleView, once an eager call or a graph ran with it

        def forget(_, value=value):
            _MODULES.pop(value, None)

        with _MODULES_LOCK:
            _MODULES[value] = weakref.ref(module, forget)
            _BY_STRUCTURE.setdefault(structure, weakref.WeakSet()).add(module)

    def __deepcopy__(self, memo):
        # copy.deepcopy(model): the copy gets a handle of its own.
        ref = _MODULES.get(self.value)
        owner = ref() if ref is not None else None
        copy = memo.get(id(owner)) if owner is not None else None
        if copy is None:
            return _UNBOUND
        # The copy's own state is not set yet; it has the original's structure.
        return _ModuleHandle(copy, _module_structure(owner)[0])

    def __reduce__(self):
        # Handle values are process-local: an unpickled module gets a new
        # handle when torchleaf next sees it.
        return (_unbound_handle, ())


class _UnboundHandle:
    """What a handle becomes in an unpickled module: it names no module. A
    type of its own, so that traced code tells it from a module's handle by
    a type guard, which all modules share (a guard on a handle's value would
    give each module a graph of its own)."""

    value = 0
    view = None

    def __reduce__(self):
        return (_unbound_handle, ())

    def __deepcopy__(self, memo):
        return self


_UNBOUND = _UnboundHandle()


def _unbound_handle():
    return _UNBOUND


def _module_state(module):
    """(names, aliases, n_params, tensors): each distinct parameter and
    buffer once, parameters first, in the order graphs pass them, and
    (name, index) for every further name of one of them (tied weights, a
    submodule used twice)."""
    names, aliases, tensors = [], [], []
    n_params = None
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in named:
            for i, seen in enumerate(tensors):
                if seen is t:
                    aliases.append((name, i))
                    break
            else:
                names.append(name)
                tensors.append(t)
        if n_params is None:  # after the parameters (a module may have none)
            n_params = len(tensors)
    return tuple(names), tuple(aliases), n_params, tensors


def _module_state_by_id(module):
    """_module_state in one pass (identity by id(); the tensors stay alive in
    the result). _module_state itself stays as it is: Dynamo traces it."""
    names, aliases, tensors, seen = [], [], [], {}
    n_params = None
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in named:
            i = seen.get(id(t))
            if i is not None:
                aliases.append((name, i))
            else:
                seen[id(t)] = len(tensors)
                names.append(name)
                tensors.append(t)
        if n_params is None:  # after the parameters (a module may have none)
            n_params = len(tensors)
    return tuple(names), tuple(aliases), n_params, tensors


def _module_structure(module):
    """(structure, tensors): what a plan keys on for a module argument."""
    names, aliases, n_params, tensors = _module_state_by_id(module)
    cls = type(module)
    return (cls.__module__, cls.__qualname__, names, aliases, n_params), tensors


# ------------------------------------------------------------ module views
# A module argument costs what its parameters cost: each one is an operator
# input, and the real function runs with the call's tensors in their places.
# Walking the module (named_parameters, PyTorch's _reparametrize_module) for
# every call cost milliseconds for a few hundred parameters, so what a walk
# finds is kept in a _ModuleView on the module's handle: the structure, the
# tensors, and where each name lives (its owner's _parameters or _buffers
# dict). A call checks that nothing changed -- every submodule, dict and
# tensor is still the one seen, by identity, at C speed -- and walks again
# only when something did.
_is = operator.is_
_dict_get = dict.get
_dict_set = dict.__setitem__
_get_version = operator.attrgetter("_version")
_get_parameters = operator.attrgetter("_parameters")
_get_buffers = operator.attrgetter("_buffers")
_get_modules = operator.attrgetter("_modules")


class _ModuleView:
    """One walk of a module: its structure and tensors (as _module_structure
    gives them), where to put the call's tensors, and what to re-check. It
    holds the module's submodules, dicts and tensors, never the module
    itself (it lives on the module's handle)."""

    __slots__ = (
        "structure", "tensors", "slot_dicts", "slot_keys", "slot_index", "slot_names",
        "submodules", "parameters", "buffers", "children", "dicts", "lengths",
        "entry_dicts", "entry_keys", "entry_values",
    )

    def __init__(self, module):
        submodules, entry_dicts, entry_keys, entry_values = [], [], [], []
        where = {}  # name -> (owner dict, key)
        for prefix, sub in module.named_modules(remove_duplicate=False):
            if sub is not module:
                submodules.append(sub)
            dot = prefix + "." if prefix else ""
            for d in (sub._parameters, sub._buffers):
                for key, t in d.items():
                    entry_dicts.append(d)
                    entry_keys.append(key)
                    entry_values.append(t)
                    if t is not None:
                        where[dot + key] = (d, key)
            for key, child in sub._modules.items():
                entry_dicts.append(sub._modules)
                entry_keys.append(key)
                entry_values.append(child)
        self.submodules = submodules
        everything = [module, *submodules]
        self.parameters = list(map(_get_parameters, everything))
        self.buffers = list(map(_get_buffers, everything))
        self.children = list(map(_get_modules, everything))
        self.dicts = self.parameters + self.buffers + self.children
        self.lengths = list(map(len, self.dicts))
        self.entry_dicts, self.entry_keys, self.entry_values = entry_dicts, entry_keys, entry_values
        # The structure as every other path computes it (named_parameters may
        # be overridden); slots only when the walk found every name there.
        self.structure, self.tensors = _module_structure(module)
        names, aliases = self.structure[2], self.structure[3]
        dicts, keys, index, slot_names, owners = [], [], [], [], set()
        for name, i in itertools.chain(((name, i) for i, name in enumerate(names)), aliases):
            found = where.get(name)
            if found is None:
                self.slot_dicts = None  # not a plain module: bound by name
                return
            d, key = found
            # A name of an attribute that another name already sets (one
            # submodule used twice) is set once.
            if (id(d), key) not in owners:
                owners.add((id(d), key))
                dicts.append(d)
                keys.append(key)
                index.append(i)
                slot_names.append(name)
        self.slot_dicts, self.slot_keys, self.slot_index, self.slot_names = dicts, keys, index, slot_names

    def unchanged(self, module, restored=None):
        """Whether `module` still has exactly what the walk saw: the same
        submodules, dicts and tensors, and nothing added. With `restored`
        ({(id(dict), key): tensor}), those entries must hold those tensors
        instead: what a call put back where an enclosing call of the same
        leaf had set its own (a module and one of its submodules passed
        together)."""
        everything = (module, *self.submodules)
        if not (
            all(map(_is, map(_get_parameters, everything), self.parameters))
            and all(map(_is, map(_get_buffers, everything), self.buffers))
            and all(map(_is, map(_get_modules, everything), self.children))
            and list(map(len, self.dicts)) == self.lengths
        ):
            return False
        if restored is None:
            return all(map(_is, map(_dict_get, self.entry_dicts, self.entry_keys), self.entry_values))
        return all(
            d.get(key) is restored.get((id(d), key), value)
            for d, key, value in zip(self.entry_dicts, self.entry_keys, self.entry_values)
        )


def _own_handle(module):
    """The module's handle if it names this module (not the original of a
    shallow copy), else None."""
    handle = module.__dict__.get(_HANDLE_ATTR)
    if handle is not None:
        ref = _MODULES.get(handle.value)
        if ref is not None and ref() is module:
            return handle
    return None


class _CheckedArguments(list):
    """An eager call's flat arguments, with the views of its modules that
    the call checked when it made its plan: its real function, moments later
    (only C++ runs in between), uses them rather than checking again."""

    __slots__ = ("views",)

    def __init__(self, flat, views):
        super().__init__(flat)
        self.views = views


def _module_view(module, handle=None):
    """The module's view, walked again when the module changed."""
    if handle is None:
        handle = _own_handle(module)
    view = handle.view if handle is not None else None
    if view is None or not view.unchanged(module):
        view = _ModuleView(module)
        if handle is not None:
            handle.view = view
    return view


# Handles made while Dynamo traced a module that had none (_sight_module),
# not yet set on the module: Dynamo may restart the trace (after a graph
# break later in the frame, e.g. loss.backward() in a compiled training
# step), and the restarted trace must see the module as the first did. Set on
# the module when it first runs (or is seen eagerly).
_PENDING = weakref.WeakKeyDictionary()  # module -> _ModuleHandle


def _handle_of(module, structure):
    """The module's handle, made on first sight (or after a copy or unpickling
    left it with one that names another module)."""
    handle = _own_handle(module)
    if handle is not None:
        return handle
    handle = _PENDING.pop(module, None) or _ModuleHandle(module, structure)
    module.__dict__[_HANDLE_ATTR] = handle
    return handle


def _module_of_structure(structure, tensors):
    """A live module that has `structure` now (preferring one whose tensors
    have the shapes of `tensors`), or None. Modules are filed by the
    structure they had when torchleaf first saw them; one that changed since
    (a parametrization, a buffer registered, a submodule added) is filed
    again when no module is found under its new one."""
    for rescanned in (False, True):
        if rescanned:
            with _MODULES_LOCK:
                refs = list(_MODULES.values())
            for ref in refs:
                module = ref()
                if module is not None:
                    now = _module_structure(module)[0]
                    with _MODULES_LOCK:
                        _BY_STRUCTURE.setdefault(now, weakref.WeakSet()).add(module)
        with _MODULES_LOCK:
            candidates = list(_BY_STRUCTURE.get(structure, ()))
        fallback = None
        for module in candidates:
            now, own = _module_structure(module)
            if now != structure:
                continue
            if all(a.shape == b.shape for a, b in zip(own, tensors)):
                return module
            if fallback is None:
                fallback = module
        if fallback is not None:
            return fallback
    return None


def _module_at_run_time(leaf, handle, structure, tensors, fake):
    if fake or type(handle) is not _Tensor or handle.is_meta:
        # Fake tensors: any live module of this structure, preferring one whose
        # tensors have the call's shapes.
        module = _module_of_structure(structure, tensors)
        if module is not None:
            return module
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' was traced with a {structure[1]} argument, "
            f"but no module of that structure (parameters and buffers {list(structure[2])}) is "
            f"alive to run its fake implementation on."
        )
    ref = _MODULES.get(int(handle))
    module = ref() if ref is not None else None
    if _PENDING and module is not None and type(module.__dict__.get(_HANDLE_ATTR)) is not _ModuleHandle:
        pending = _PENDING.pop(module, None)
        if pending is not None:
            module.__dict__[_HANDLE_ATTR] = pending
    if module is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' was called from a graph with a "
            f"{structure[1]} argument that torchleaf cannot find: the module passed is a shallow "
            f"copy (copy.copy) of one that was deleted, and a shallow copy shares the original's "
            f"torchleaf handle. Use copy.deepcopy, or call the leaf with the copy once outside "
            f"the compiled region."
        )
    return module


@torch._dynamo.assume_constant_result
def _sight_module(module):
    """Called by Dynamo at trace time for a module that has no handle yet: makes
    one (the same one again in a restarted trace; see _PENDING) and returns
    its value. (Dynamo guards this trace on the module's identity; traces of
    modules that already have handles do not.)"""
    handle = _PENDING.get(module)
    if handle is None:
        handle = _PENDING[module] = _ModuleHandle(module, _module_structure(module)[0])
    return handle.value


# --------------------------------------------------------------------- outputs
# Outputs are described by a small nested tuple of constants, so that Dynamo
# can rebuild them from a constant (it cannot use a TreeSpec constant).
_OUT_TENSOR, _OUT_TUPLE, _OUT_LIST, _OUT_DICT, _OUT_CONST, _OUT_NAMEDTUPLE = range(6)
# A tuple or dict of a type of its own (a structseq such as torch.max's
# result, torch.Size, OrderedDict, defaultdict, a dict subclass): rebuilt
# as that type from the leaf's table (_output_types).
_OUT_TYPED_TUPLE, _OUT_TYPED_DICT = 6, 7
# An int output that a traced graph cannot hold as a constant: the fake
# returned a SymInt (a size of a dynamic input, an unbacked size), so each
# call's int travels as the size of a zero-stride int64 carrier among the
# operator's outputs, as int arguments do: (_OUT_INT, tensor index, coding),
# coding _INT_SIZE (the int is the size: known non-negative without a
# guard) or _INT_ZIGZAG (2n, or -2n - 1 when negative). Once a trace of a
# call structure carried an int, its later traces carry it with that coding.
_OUT_INT = 8
_INT_SIZE, _INT_ZIGZAG = 0, 1
_SINGLE = (_OUT_TENSOR, 0)


def _int_carrier(leaf, n, coding):
    """The carrier of int output `n` (a SymInt when a fake returned it)."""
    if coding == _INT_ZIGZAG:
        if isinstance(n, int) and not -(2**62) <= n < 2**62:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' returned {n}, which a compiled call cannot "
                f"return where its fake returned a SymInt (|n| < 2**62)."
            )
        size = torch.sym_max(2 * n, -2 * n - 1)
    elif isinstance(n, int) and n < 0:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' returned {n} where its fake returned a size "
            f"(a non-negative int): make the fake return an int that may be negative."
        )
    else:
        size = n
    # (empty_strided: an expand would be a view, whose base shares its
    # storage; the core copies an output whose storage is shared.)
    return torch.empty_strided((size,), (0,), dtype=torch.int64)


def _int_of_carrier(carrier, coding):
    size = carrier.shape[0]
    if coding == _INT_SIZE:
        return size
    odd = size % 2
    return (size // 2) * (1 - odd) - ((size + 1) // 2) * odd


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
            coding = _INT_SIZE if obj.node.expr.is_Symbol and statically_known_true(obj >= 0) else _INT_ZIGZAG
        tensors.append(_int_carrier(leaf, obj, coding))
        return (_OUT_INT, len(tensors) - 1, coding)
    if traced is not None and traced[0] == _OUT_INT and type(obj) is int:
        tensors.append(_int_carrier(leaf, obj, traced[2]))
        return (_OUT_INT, len(tensors) - 1, traced[2])
    if isinstance(obj, tuple):
        cls = type(obj)
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
        cls = type(obj)
        if cls is not dict and not _rebuilt_exactly(obj, cls, dict):
            cls = dict  # returned as a plain dict
        keys = tuple(obj.keys())
        kind = _OUT_DICT if cls is dict else _OUT_TYPED_DICT
        children = _encode_all(leaf, obj.values(), tensors, _traced_children(traced, kind, len(keys), keys))
        if cls is dict:
            return (_OUT_DICT, keys, children)
        if cls is collections.defaultdict:
            # By the factory's name, which names one factory (_rebuilt_exactly).
            factory = obj.default_factory
            key = f"collections.defaultdict({_function_name(factory) if factory is not None else None})"
            build = functools.partial(collections.defaultdict, factory)
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


def _decode(desc, tensors, types=None):
    """The output `desc` describes, from its tensors; `types` (compiled
    code) is the leaf's _output_types, from which typed containers are
    built, else from the description."""
    kind = desc[0]
    if kind == _OUT_TENSOR:
        return tensors[desc[1]]
    if kind == _OUT_TUPLE:
        return tuple(_decode(d, tensors, types) for d in desc[1])
    if kind == _OUT_LIST:
        return [_decode(d, tensors, types) for d in desc[1]]
    if kind == _OUT_DICT:
        return dict(zip(desc[1], [_decode(d, tensors, types) for d in desc[2]]))
    if kind == _OUT_NAMEDTUPLE:
        cls = desc[1] if types is None else types[desc[3]]
        return cls(*[_decode(d, tensors, types) for d in desc[2]])
    if kind == _OUT_TYPED_TUPLE:
        build = desc[4] if types is None else types[desc[3]]
        return build([_decode(d, tensors, types) for d in desc[2]])
    if kind == _OUT_TYPED_DICT:
        build = desc[4] if types is None else types[desc[3]]
        return build(zip(desc[1], [_decode(d, tensors, types) for d in desc[2]]))
    if kind == _OUT_INT:
        return _int_of_carrier(tensors[desc[1]], desc[2])
    return desc[1]


def _structure(desc, carried_as_int=False):
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
    children = (_structure(d, carried_as_int) for d in desc[2 if kind in _KEYED_KINDS else 1])
    if kind == _OUT_DICT:
        return (kind, desc[1], tuple(children))
    if kind == _OUT_NAMEDTUPLE or kind == _OUT_TYPED_TUPLE:
        return (kind, desc[3], tuple(children))
    if kind == _OUT_TYPED_DICT:
        return (kind, desc[3], desc[1], tuple(children))
    return (kind, tuple(children))


# Description kinds whose children are desc[2] (else desc[1]).
_KEYED_KINDS = (_OUT_DICT, _OUT_NAMEDTUPLE, _OUT_TYPED_TUPLE, _OUT_TYPED_DICT)


def _constants(desc, path="output"):
    """(path, value) for every constant in a description."""
    kind = desc[0]
    if kind == _OUT_CONST:
        yield path, desc[1]
    elif kind == _OUT_DICT or kind == _OUT_TYPED_DICT:
        for key, d in zip(desc[1], desc[2]):
            yield from _constants(d, f"{path}[{key!r}]")
    elif kind == _OUT_NAMEDTUPLE:
        for name, d in zip(desc[1]._fields, desc[2]):
            yield from _constants(d, f"{path}.{name}")
    elif kind == _OUT_TYPED_TUPLE:
        for i, d in enumerate(desc[2]):
            yield from _constants(d, f"{path}[{i}]")
    elif kind != _OUT_TENSOR and kind != _OUT_INT:
        for i, d in enumerate(desc[1]):
            yield from _constants(d, f"{path}[{i}]")


def _flatten_output(leaf, out, traced=None):
    if isinstance(out, _Tensor):  # fake tensors too: one description object
        return [out], _SINGLE
    tensors = []
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


def _has_int_carriers(desc):
    return any(d[0] == _OUT_INT for d in _operator_outputs(desc))


def _output_checks(desc, flat):
    """What traced code checks of a call's real outputs (_check_traced_outputs),
    from the fake's: (index, zigzag) for each int carried as a size, (index,
    None) for each tensor output with a symbolic size. Static sizes are
    checked inside the leaf's operator (output_check.h)."""
    checks = []
    for d in _operator_outputs(desc):
        if d[0] == _OUT_INT:
            checks.append((d[1], d[2] == _INT_ZIGZAG))
        elif any(isinstance(s, torch.SymInt) for s in flat[d[1]].shape):
            checks.append((d[1], None))
    return tuple(checks)


def _check_traced_outputs(leaf, checks, outputs):
    """In traced code, check what the graph takes from the fake against the
    real outputs (_output_checks). The graph computes a carried int or a
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


def _structure_mismatch(leaf, real, fake):
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


def _fake_structure_varied(leaf, earlier, later):
    return LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' has a fake implementation that returned two "
        f"output structures for one call structure:\n  {_show(earlier)}\n  {_show(later)}\n"
        f"A compiled graph keeps the structure its trace saw, so a call could return the other "
        f"one's. The fake must depend only on its arguments: it runs on any module of a module "
        f"argument's structure, so pass a setting it reads from the module (such as "
        f"self.training) as an argument of the leaf."
    )


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _check_fake_constants(leaf, desc):
    """A fake's non-tensor outputs become graph constants: only plain values."""
    for _, value in _constants(desc):
        if not isinstance(value, _CONSTANT_TYPES):
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


def _check_graph_constants(leaf, traced, real, from_real=False):
    """A graph returns the constants its fake returned when it was traced; a
    real call that returns other values would be silently wrong. So does a
    call through the operator that no fake described (a dispatch mode, a
    torch.func transform): its caller gets the first such call's constants."""
    for (path, fake_value), (_, real_value) in zip(_constants(traced), _constants(real)):
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


def _add_note(e, note):
    notes = getattr(e, "__notes__", ())
    if note not in notes and hasattr(e, "add_note"):
        e.add_note(note)


# ----------------------------------------------------------------------- plans
_MAX_CARRIED_INT = 2**62
# What a fake sees for a float argument of a compiled call.
_FAKE_FLOAT = 1.0

# How a plan's calls are made: eagerly (arguments passed along), traced by
# make_fx or fake tensors (constants baked in), or compiled by Dynamo (also
# ordered by a token).
_EAGER, _TRACED, _COMPILED = range(3)

# The order token of compiled calls: each call of a graph after the first
# takes the one the previous call returned, and the last one is stored back
# here when the graph has run. Read as a graph input only by a graph's first
# call that mutates, and inside higher-order operators' bodies. No data.
_ORDER_TOKEN = torch.empty(0, dtype=torch.int64)


def _new_order_token():
    return torch.empty(0, dtype=torch.int64)


# Dynamo guards each global that traced code reads, and each attribute on
# the way, on every call of a compiled frame: one global each instead of
# torch.compiler.is_dynamo_compiling's chain of three and torch.ops.torchleaf.call's
# four.
# is_dynamo_compiling, not is_compiling: torch 2.13's is_compiling reads a
# process-wide flag that is set while any thread compiles, and an eager call
# in another thread would take the traced path.
_is_compiling = torch.compiler.is_dynamo_compiling
_is_exporting = torch.compiler.is_exporting
_CALL = torch.ops.torchleaf.call.default
_CALL_MUTATING = torch.ops.torchleaf.call_mutating.default
_CHECK_CARRIED_INT = torch.ops.torchleaf.check_carried_int.default
_CHECK_OUTPUT_SIZES = torch.ops.torchleaf.check_output_sizes.default


# Kinds of operator inputs, in a plan's order.
_IN_TENSOR, _IN_MODULE, _IN_INT, _IN_NEGATIVE_INT, _IN_NDARRAY, _IN_FLOAT = range(6)
# A module named in mutates_args: its parameters are inputs, its buffers are
# declared mutable (BatchNorm's running statistics).
_IN_MODULE_MUTABLE_BUFFERS = 6
# An int whose sign a trace cannot know without a data-dependent guard (an
# unbacked int from .item()): carried as a zigzag-coded size.
_IN_SIGNED_INT = 7
_MODULE_KINDS = (_IN_MODULE, _IN_MODULE_MUTABLE_BUFFERS)
_TENSOR = "\x00torchleaf:tensor"  # stands for a tensor in a call's key
_MODULE = "\x00torchleaf:module"  # stands for a module in a compiled call's skeleton
_MODULE_KEY = "\x00torchleaf:module"  # tags (tag, structure) module entries of a key
_NDARRAY = "\x00torchleaf:ndarray"  # a numpy array a traced call passes as a tensor
_FLOAT = "\x00torchleaf:float"  # a float a compiled program passes as a 0-dim tensor
_INT = "\x00torchleaf:int"  # an int a compiled program passes as a carrier's size
_NEGATIVE_INT = "\x00torchleaf:-int"
_SIGNED_INT = "\x00torchleaf:zigzag-int"


_FINGERPRINT_MASK = (1 << 62) - 1


def _fingerprint(full_key):
    """A plan's index: the same for the same call structure in every process.
    Graphs hold the index as a constant, and PyTorch's on-disk compile caches
    hand a graph compiled in one process to another whose graph reads alike:
    the index must then name the same call structure there (constants baked
    into the plan, which the graph does not show, included)."""
    try:
        text = repr(full_key)
    except Exception:  # a constant whose repr fails: a fingerprint of this process only
        text = f"{os.getpid()}:{id(full_key)}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _FINGERPRINT_MASK


class _Plan:
    """How to rebuild one call structure's arguments from the operator's tensors.

    The operator receives ``inputs`` -- per ``slots`` entry a tensor, a
    module's parameters and buffers, or an int carrier; then, for traced
    plans, one handle tensor per module; then, for compiled plans, the
    order token (not on a graph's first non-mutating call) -- and
    ``mutated``: tensor leaves of the parameters named in ``mutates_args``,
    then the buffers of modules named there, in that order.
    Compiled plans also return a new order token after the function's
    outputs.
    """

    __slots__ = (
        "index", "spec", "template", "slots", "mutated", "ordered", "positional", "out",
        "out_plain", "out_from_real", "out_carries", "out_checks", "out_varied", "autocast", "out_dtypes",
        "grad", "containers",
    )

    def __init__(self, index, spec, template, slots, mutated, mode, positional, autocast=None, grad=False):
        self.index = index
        self.spec = spec
        # The flat arguments with baked constants (traced plans) and None
        # where tensors, modules and carried ints go.
        self.template = template
        self.slots = slots  # ((kind, flat position, module structure or None), ...)
        self.mutated = mutated  # flat positions of declared-mutable tensors
        self.ordered = mode == _COMPILED
        self.positional = positional  # tensors only, by position: call fn(*tensors)
        # (args index or kwargs key, first flat position, spec, leaves only)
        # of each argument that holds a mutable container, which the real
        # function gets rebuilt (check_containers_unchanged).
        self.containers = () if positional else _mutable_container_arguments(spec)
        self.out = None  # the fake's output description, once traced
        self.out_plain = False  # whether `out` holds no constants
        self.out_from_real = False  # `out` came from a real call, no fake ran
        self.out_carries = False  # `out` has ints that travel as carriers (_OUT_INT)
        self.out_checks = ()  # what the latest trace's code checks (_output_checks)
        # (earlier, later) descriptions of two fake runs for this call
        # structure whose structures differ: compiled code may keep either.
        self.out_varied = None
        # Compiled plans: the autocast state the call was traced under
        # (_autocast_state), entered around its fake and its real function.
        self.autocast = autocast
        # Compiled plans traced under autocast: the fake's output dtypes,
        # which the real outputs must have.
        self.out_dtypes = None
        # Compiled plans: whether grad mode was on where the call was traced
        # (Dynamo guards it), so that the real function runs with it on as
        # it would in eager code (_run_real).
        self.grad = grad

    def takes_token(self, n_inputs):
        """Whether a call whose ``inputs`` hold ``n_inputs`` tensors ends them
        with an order token: compiled calls do, except a graph's first
        non-mutating one (_first_ordered_call)."""
        if not self.ordered:
            return False
        n = 0
        for kind, _, structure in self.slots:
            if kind in _MODULE_KINDS:  # its parameters and buffers (those in `inputs`), its handle
                n += _module_inputs(kind, structure) + 1
            else:
                n += 1
        return n_inputs > n

    def record_output(self, leaf, desc, from_real=False, flat=None):
        """Record the description of what a traced graph returns for this
        call structure (with `flat`, the fake's outputs, what traced code
        checks against the real ones: _output_checks)."""
        if (
            self.out is not None
            and not self.out_from_real
            and _structure(self.out, carried_as_int=True) != _structure(desc, carried_as_int=True)
        ):
            # Graphs traced with the earlier structure would return it: their
            # calls fail from now on (check_output), and so does this trace.
            self.out_varied = (self.out, desc)
            raise _fake_structure_varied(leaf, self.out, desc)
        self.out = desc
        self.out_plain = next(_constants(desc), None) is None
        self.out_from_real = from_real
        self.out_carries = _has_int_carriers(desc)
        self.out_checks = () if flat is None else _output_checks(desc, flat)

    def check_output(self, leaf, desc):
        """Check a real call's output description against the traced one: a
        graph returns the traced structure and constants, whatever the real
        function returns. Without constants, equal descriptions are equal
        structures, which a tuple comparison tells at C speed on every call."""
        traced = self.out
        if self.out_varied is not None:
            raise _fake_structure_varied(leaf, *self.out_varied)
        if traced is None:
            self.record_output(leaf, desc, from_real=True)  # no fake ran (a non-tracing dispatch mode)
        elif traced is not desc and not (self.out_plain and traced == desc):
            if _structure(traced) != _structure(desc):
                raise _structure_mismatch(leaf, desc, traced)
            _check_graph_constants(leaf, traced, desc, self.out_from_real)

    def rebuild(self, leaf, tensors, arguments, fake):
        """(args, kwargs, [(module, structure, tensors, kind)], flat) for one
        call; `flat`, the leaves (args, kwargs) were built from."""
        flat = list(arguments) if arguments is not None else list(self.template)
        k = 0
        modules = []
        for kind, pos, structure in self.slots:
            if kind == _IN_TENSOR:
                flat[pos] = tensors[k]
                k += 1
            elif kind == _IN_NDARRAY:
                # The real function gets its array back (sharing memory);
                # a fake, running on fake tensors, gets the tensor.
                t = tensors[k]
                flat[pos] = t if fake and (type(t) is not _Tensor or t.is_meta) else t.numpy()
                k += 1
            elif kind == _IN_FLOAT:
                # Dynamo does not specialize floats: the value reaches the
                # function at run time. A fake gets the traced value's
                # placeholder (fake tensors hold no data).
                t = tensors[k]
                flat[pos] = _FAKE_FLOAT if fake and (type(t) is not _Tensor or t.is_meta) else t.item()
                k += 1
            elif kind in _MODULE_KINDS:
                n = _module_inputs(kind, structure)
                modules.append((pos, structure, list(tensors[k : k + n]), kind))
                k += n
            else:  # an int carried as a size
                size = tensors[k].shape[0]
                if kind == _IN_SIGNED_INT:
                    # Zigzag: 2n for n >= 0, -2n - 1 for n < 0; arithmetic
                    # only, so that a fake gets a symbolic int unguarded.
                    half, odd = size // 2, size % 2
                    flat[pos] = half * (1 - 2 * odd) - odd
                else:
                    flat[pos] = size if kind == _IN_INT else -size
                k += 1
        if arguments is None:
            for pos, structure, own, _ in modules:
                flat[pos] = _module_at_run_time(leaf, tensors[k], structure, own, fake)
                k += 1
        if self.ordered and k < len(tensors):
            k += 1  # the order token (a graph's first call has none, unless it mutates)
        for pos in self.mutated:
            flat[pos] = tensors[k]
            k += 1
        bindings = []
        for pos, structure, own, kind in modules:
            if kind == _IN_MODULE_MUTABLE_BUFFERS:  # its buffers come last
                n = len(structure[2]) - structure[4]
                own.extend(tensors[k : k + n])
                k += n
            module = flat[pos]
            # The same module passed twice is bound once: its first slot's
            # tensors go unused (zero gradients, which add up right).
            bindings = [b for b in bindings if b[0] is not module]
            bindings.append((module, structure, own, kind))
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return args, kwargs, bindings, flat

    def check_containers_unchanged(self, leaf, args, kwargs, flat):
        """After the real function ran on containers rebuilt for the call:
        an error if it changed one in place (``log.append(...)``,
        ``cfg["k"] = v``), which the caller's own container would never see."""
        for key, start, spec, leaves_only in self.containers:
            obj = args[key] if type(key) is int else kwargs[key]
            changed = _changed_container(obj, spec, flat, start, leaves_only)
            if changed is None:
                continue
            name = leaf._parameter_name(key)
            what = f"argument {name!r}" if name is not None else f"positional argument {key}"
            what = f"its {what} (a {type(obj).__name__})" if changed is obj else (
                f"a {type(changed).__name__} inside its {what}"
            )
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' changed {what} in place. A leaf function "
                f"gets its own copy of each list, dict or other container it is passed (the tensors "
                f"inside become the call's own), so the caller's container would not see the change. "
                f"Return what the function computes and update the container outside the leaf, or "
                f"pass an object of a class of your own, which the function gets itself."
            )


def _changed_container(obj, spec, flat, start, leaves_only=None):
    """The container in `obj`, rebuilt for a call as `spec` describes with
    the leaves flat[start:], that the function changed in place; None if
    none. `leaves_only`: whether `spec`'s children are all leaves (computed
    when not given)."""
    t = spec.type
    if t is list or t is tuple:
        if type(obj) is not t or len(obj) != spec.num_children:
            return obj
        items = obj
    elif t is dict:
        if type(obj) is not dict or list(obj) != spec.context:  # (a defaultdict read adds a key)
            return obj
        items = obj.values()
    else:  # another pytree node: compared through the pytree
        leaves, now = pytree.tree_flatten(obj)
        same = now == spec and all(map(operator.is_, leaves, flat[start : start + spec.num_leaves]))
        return None if same else obj
    children = spec.children()
    if leaves_only is None:
        leaves_only = all(child.is_leaf() for child in children)
    if leaves_only:
        return None if all(map(operator.is_, items, flat[start : start + len(children)])) else obj
    for item, child in zip(items, children):
        if child.is_leaf():
            if item is not flat[start]:
                return obj
        else:
            changed = _changed_container(item, child, flat, start)
            if changed is not None:
                return changed
        start += child.num_leaves
    return None


def _mutable_container_arguments(spec):
    """(args index or kwargs key, first flat position, spec, whether its
    children are all leaves) of the top-level call arguments in `spec`
    ((args, kwargs)) that hold a container other than a tuple."""
    args_spec, kwargs_spec = spec.children()
    names = list(range(args_spec.num_children)) + list(kwargs_spec.context)
    found, start = [], 0
    for name, sub in zip(names, [*args_spec.children(), *kwargs_spec.children()]):
        if _holds_mutable_container(sub):
            found.append((name, start, sub, all(child.is_leaf() for child in sub.children())))
        start += sub.num_leaves
    return tuple(found)


def _holds_mutable_container(spec):
    if spec.is_leaf():
        return False
    if not issubclass(spec.type, tuple):  # a list, a dict, a dataclass...
        return True
    return any(_holds_mutable_container(child) for child in spec.children())


def _module_inputs(kind, structure):
    """How many of a module slot's tensors the operator takes as inputs: all,
    or (buffers declared mutable) its parameters; the rest are mutated."""
    return len(structure[2]) if kind == _IN_MODULE else structure[4]


def _split_module_tensors(kind, structure, tensors, inputs, mutable_buffers):
    """A module's tensors: all inputs, or (declared mutable) parameters as
    inputs and buffers as mutated tensors."""
    n = _module_inputs(kind, structure)
    inputs.extend(tensors[:n])
    mutable_buffers.extend(tensors[n:])


def _owner(module, name):
    prefix, _, attr = name.rpartition(".")
    return (id(module.get_submodule(prefix)), attr)


def _add_aliases(module, mapping, names, aliases, own):
    """Map the further names of tied tensors that are attributes of their own
    (tied weights of two modules). A name of an attribute that another name
    already sets (one submodule used twice) stays out: setting it twice
    would make PyTorch's _reparametrize_module restore the wrong tensor, and
    tie_weights=True does not restore the originals either."""
    owners = {_owner(module, name) for name in names}
    for name, i in aliases:
        owner = _owner(module, name)
        if owner not in owners:
            owners.add(owner)
            mapping[name] = own[i]


def _invoke(leaf, fn, plan, tensors, arguments, fake):
    if plan.positional:
        return fn(*tensors[: len(plan.slots)]) if plan.ordered else fn(*tensors)
    args, kwargs, bindings, flat = plan.rebuild(leaf, tensors, arguments, fake)
    if not bindings:
        out = fn(*args, **kwargs)
        if plan.containers and not fake:
            plan.check_containers_unchanged(leaf, args, kwargs, flat)
        return out
    checked = arguments.views if type(arguments) is _CheckedArguments else ()
    binders = []
    for module, structure, own, kind in bindings:
        view = next((v for m, v in checked if m is module), None)
        binders.append(_Binder(module, structure, own, kind, view))
    # The call's tensors are the modules' while the function runs: no other
    # thread's call may read or swap them meanwhile (it would take this
    # call's aliases as the module's tensors, and restore them in place of
    # the originals). Reentrant: a leaf may call a leaf.
    with _MODULE_CALLS_LOCK:
        entered = []
        try:
            for binder in binders:
                binder.enter()
                entered.append(binder)
            out = fn(*args, **kwargs)
        finally:
            while entered:
                entered.pop().exit()
    for binder in binders:
        binder.check(leaf)
    if plan.containers and not fake:
        plan.check_containers_unchanged(leaf, args, kwargs, flat)
    return out


# Held by a call with module arguments from reading the modules' tensors
# until its function has run and the tensors are back (_invoke).
_MODULE_CALLS_LOCK = threading.RLock()


def _new_module_calls_lock():
    # A child forked while another thread held the lock (a fork DataLoader
    # worker, multiprocessing) would wait forever for a thread it lacks.
    global _MODULE_CALLS_LOCK
    _MODULE_CALLS_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_module_calls_lock)


class _Binder:
    """Runs the function with one module's parameters and buffers replaced by
    the call's tensors: written straight into the dicts that hold them (the
    module's view says where), restored afterwards. A module whose view
    cannot say (named_parameters overridden, or a structure other than the
    plan's) goes through PyTorch's _reparametrize_module by name."""

    __slots__ = ("module", "structure", "own", "kind", "view", "new", "old", "versions", "replaced", "ctx", "mapping")

    def __init__(self, module, structure, own, kind, view=None):
        self.module, self.structure, self.own, self.kind = module, structure, own, kind
        if view is None:
            view = _module_view(module)
        if view.slot_dicts is None or (view.structure is not structure and view.structure != structure):
            view = None
        self.view = view
        self.replaced = None
        self.ctx = None
        # In-place changes to a module's tensors are the C++ core's undeclared
        # mutation error too, but only Python knows their names.
        self.versions = None
        if kind == _IN_MODULE:
            try:
                self.versions = list(map(_get_version, own))
            except RuntimeError:  # inference tensors have no version counter
                self.versions = [None if t.is_inference() else t._version for t in own]

    def enter(self):
        view = self.view
        if view is None:
            mapping = dict(zip(self.structure[2], self.own))
            if self.structure[3]:
                _add_aliases(self.module, mapping, self.structure[2], self.structure[3], self.own)
            self.mapping = mapping
            # Not strict: a name of an attribute that another name of the
            # mapping already sets is left out (see _add_aliases).
            self.ctx = _reparametrize_module(self.module, mapping, tie_weights=False, strict=False)
            self.ctx.__enter__()
            return
        own = self.own
        self.new = [own[i] for i in view.slot_index]
        self.old = list(map(_dict_get, view.slot_dicts, view.slot_keys))
        for _ in map(_dict_set, view.slot_dicts, view.slot_keys, self.new):
            pass

    def exit(self):
        if self.ctx is not None:
            try:
                current = dict(self.module.named_parameters(remove_duplicate=False))
                current.update(self.module.named_buffers(remove_duplicate=False))
                for name, tensor in self.mapping.items():
                    if current.get(name) is not tensor:
                        self.replaced = name
                        break
            finally:
                self.ctx.__exit__(None, None, None)
            return
        view = self.view
        dicts, keys = view.slot_dicts, view.slot_keys
        if not all(map(_is, map(_dict_get, dicts, keys), self.new)):
            for name, d, key, t in zip(view.slot_names, dicts, keys, self.new):
                if d.get(key) is not t:
                    self.replaced = name
                    break
        for _ in map(_dict_set, dicts, keys, self.old):
            pass
        if (
            self.replaced is None
            and not view.unchanged(self.module)
            and not view.unchanged(self.module, {(id(d), key): t for d, key, t in zip(dicts, keys, self.old)})
        ):
            # Something else changed during the call (a submodule assigned):
            # compare by name, as the function saw the module.
            current = dict(self.module.named_parameters(remove_duplicate=False))
            current.update(self.module.named_buffers(remove_duplicate=False))
            for name, i in itertools.chain(((n, i) for i, n in enumerate(self.structure[2])), self.structure[3]):
                if current.get(name) is not view.tensors[i]:
                    self.replaced = name
                    break

    def check(self, leaf):
        if self.versions is not None:
            try:
                changed = list(map(_get_version, self.own)) != self.versions
            except RuntimeError:  # inference tensors: compare one by one
                changed = True
            for name, t, version in zip(self.structure[2], self.own, self.versions) if changed else ():
                if version is not None and t._version != version:
                    raise LeafFunctionError(
                        f"torchleaf: leaf function '{leaf._name}' changed '{name}' of its "
                        f"{type(self.module).__name__} argument in place without declaring it. Name that "
                        f"argument in mutates_args (its buffers may then change in place, e.g. "
                        f"BatchNorm's running statistics; its parameters never), or clone first."
                    )
        if self.replaced is not None:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' replaced '{self.replaced}' of its "
                f"{type(self.module).__name__} argument. The module's parameters and buffers "
                f"are the leaf's inputs and must not be reassigned inside it; return the "
                f"new value instead."
            )


# ------------------------------------------------------------------ autocast
# A compiled program's runtime does not run its graph under autocast
# (AOTAutograd traced the autocast casts into the graph and disables it at
# run time), so a leaf's real function, which runs there, would not see the
# autocast it ran under eagerly. A compiled call records the autocast state it
# was traced under (part of its plan's key) and runs its fake and its real
# function under exactly that state.


def _autocast_state():
    """None when autocast is off, else (((device type, dtype), ...) for each
    device type it is on for, whether its cache is on)."""
    if not torch._C._is_any_autocast_enabled():
        return None
    enabled = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in torch._C._autocast_supported_devices()
        if torch.is_autocast_enabled(device)
    )
    return enabled, torch.is_autocast_cache_enabled()


def _invoke_compiled(leaf, fn, plan, tensors, arguments, fake):
    """_invoke under the autocast state a compiled plan was traced under."""
    state = plan.autocast
    if state is None and not _is_any_autocast_enabled():
        return _invoke(leaf, fn, plan, tensors, arguments, fake)
    enabled = dict(state[0]) if state is not None else {}
    with contextlib.ExitStack() as stack:
        for device in torch._C._autocast_supported_devices():
            if device in enabled:
                stack.enter_context(torch.autocast(device, dtype=enabled[device], cache_enabled=state[1]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return _invoke(leaf, fn, plan, tensors, arguments, fake)


def _check_autocast_dtypes(leaf, plan, flat):
    """Under autocast a fake written for full precision (x.new_empty(...))
    gives a dtype the real function does not: the compiled graph would read
    the real output as the fake's dtype."""
    for i, (t, dtype) in enumerate(zip(flat, plan.out_dtypes)):
        if isinstance(t, _Tensor) and t.dtype != dtype:
            enabled = ", ".join(f"{device}: {d}" for device, d in plan.autocast[0])
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' returned a {t.dtype} tensor at output {i} "
                f"under autocast ({enabled}), but its fake implementation gave {dtype} when the "
                f"call was compiled. The fake runs under the same autocast state as the real "
                f"function: compute its outputs with the same operations on its inputs (a @ b "
                f"gives the autocast dtype), or give them torch.get_autocast_dtype(device) when "
                f"torch.is_autocast_enabled(device)."
            )


_is_any_autocast_enabled = torch._C._is_any_autocast_enabled
_is_grad_enabled = torch.is_grad_enabled
# torch.set_grad_enabled as a function builds a context-manager object in
# Python (~5k instructions per call and back); this is what it calls.
_set_grad_enabled = torch._C._set_grad_enabled


def _live_leaf(leaf_ref):
    leaf = leaf_ref()
    if leaf is None:  # the core entry is removed with the leaf; a call in flight raced it
        raise LeafFunctionError("torchleaf: a leaf function was called after it was deleted.")
    return leaf


def _run_real(leaf_ref, plan_index, tensors, arguments):
    """Called by the core: run the user's function for one call. Returns the
    output tensors and the output description."""
    leaf = leaf_ref()
    if leaf is None:
        _live_leaf(leaf_ref)  # raises
    plan = leaf._plans[plan_index]
    # Traced where grad mode was on, run where it is off: AOTAutograd runs a
    # graph none of whose inputs requires grad, and a training graph's
    # forward, with grad mode off. The function runs as in eager code:
    # autograd inside it works, and an output computed from a closure that
    # requires grad is reported (the core's escaped-gradient check) instead
    # of losing its gradient silently. (Capturing calls have it on already.)
    grad_off = plan.grad and not _is_grad_enabled()
    if grad_off:
        _set_grad_enabled(True)
    try:
        if plan.ordered:
            if plan.positional and plan.autocast is None and not _is_any_autocast_enabled():
                # The common compiled call, inline (what _invoke_compiled and
                # _invoke do for it): each Python frame on this path is paid,
                # and its code fetched cold, on every training step.
                out = leaf._fn(*tensors[: len(plan.slots)])
            else:
                out = _invoke_compiled(leaf, leaf._fn, plan, tensors, arguments, fake=False)
        else:
            out = _invoke(leaf, leaf._fn, plan, tensors, arguments, fake=False)
    except BaseException as e:
        _add_note(e, f"raised inside the real function of leaf function '{leaf._name}'")
        raise
    finally:
        if grad_off:
            _set_grad_enabled(False)
    if isinstance(out, _Tensor) and plan.out is _SINGLE and plan.out_dtypes is None:
        # One tensor, as traced: _flatten_output's and check_output's answer.
        return ([out, None] if plan.ordered else [out]), _SINGLE
    flat, desc = _flatten_output(leaf, out, plan.out if plan.out_carries else None)
    if arguments is None:
        # Called through the operator (a graph, or a dispatch mode that runs
        # real kernels): the caller rebuilds outputs from the plan's
        # description, which the fake wrote when tracing.
        plan.check_output(leaf, desc)
    if plan.ordered:
        if plan.out_dtypes is not None:
            _check_autocast_dtypes(leaf, plan, flat)
        # The core appends a new order token in place of the None (cheaper
        # in C++ than torch.empty here, on every compiled call).
        flat = flat + [None]
    return flat, desc


def _input_name(leaf_ref, plan_index, index):
    """Called by the core for an error message: call input ``index`` of plan
    ``plan_index`` as its caller wrote it ("argument 'x'", "argument
    'model.bn.running_mean'"); None for what the caller did not pass (a
    module's handle, the order token) or cannot be placed (the mutated
    tensors after them)."""
    leaf = leaf_ref()
    plan = None if leaf is None else leaf._plans.get(plan_index)
    if plan is None:
        return None
    n = 0
    for kind, pos, structure in plan.slots:
        count = _module_inputs(kind, structure) if kind in _MODULE_KINDS else 1
        if index < n + count:
            path = leaf._argument_path(plan.spec, pos)
            if path is None or kind not in (_IN_TENSOR, _IN_NDARRAY, *_MODULE_KINDS):
                return None  # (an int's or a float's carrier: the body never sees it)
            if kind in _MODULE_KINDS:
                path += "." + structure[2][index - n]  # the tensor's name in the module
            return f"argument {path!r}"
        n += count
    return None


def _run_fake(leaf_ref, plan_index, tensors, arguments, real_desc):
    """Called by the core: run the fake for one call (tracers, or validation of
    the real call whose description is ``real_desc``)."""
    leaf = _live_leaf(leaf_ref)
    if leaf._fake is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' requires a fake implementation to be traced "
            f"(torch.compile, make_fx, torch.export, fake tensors) or validated. Register one with "
            f"@{leaf.__name__}.register_fake; it must return outputs with the same structure, "
            f"shapes and dtypes as the real function."
        )
    plan = leaf._plans[plan_index]
    try:
        if plan.ordered:
            out = _invoke_compiled(leaf, leaf._fake, plan, tensors, arguments, fake=True)
        else:
            out = _invoke(leaf, leaf._fake, plan, tensors, arguments, fake=True)
    except BaseException as e:
        _add_note(e, f"raised inside the fake implementation of leaf function '{leaf._name}'")
        if torch.compiler.is_compiling() and _names_no_leaf_under_dynamo(e):
            # Dynamo reports an exception from a fake as "got KeyError(...)"
            # on the operator call, its context (and our note) suppressed.
            raise LeafFunctionError(
                f"torchleaf: the fake implementation of leaf function '{leaf._name}' raised "
                f"{type(e).__name__}: {e}"
            ) from e
        raise
    # Where an earlier trace of this call structure returned an int as a
    # carrier, an int is one here too: the operator's outputs, which every
    # graph of the plan indexes, must not change in number (a dynamic size
    # that the next trace specialized returns a plain int).
    flat, desc = _flatten_output(leaf, out, plan.out if plan.out_carries else None)
    _check_fake_constants(leaf, desc)
    if plan.ordered:
        if plan.autocast is not None and arguments is None and real_desc is None:
            plan.out_dtypes = tuple(t.dtype if isinstance(t, _Tensor) else None for t in flat)
        flat = flat + [_new_order_token()]
    if real_desc is not None:
        if _structure(real_desc) != _structure(desc):
            raise _structure_mismatch(leaf, real_desc, desc)
    elif arguments is None:
        plan.record_output(leaf, desc, flat=flat)  # what a traced graph returns for this call structure
    return flat


def _names_no_leaf_under_dynamo(e):
    """Whether an exception from a fake would reach a torch.compile user
    without the leaf's name: the user's own (or Python's builtin) errors.
    Left alone: PyTorch's own (data-dependent shapes, guards, Dynamo's), and
    TypeError, which Dynamo turns into a graph break (get_fake_value): the
    compiler acts on them."""
    module = type(e).__module__ or ""
    return (
        isinstance(e, Exception)
        and not isinstance(e, (LeafFunctionError, TypeError))
        and module.split(".")[0] != "torch"
    )


def _aliases(a, b):
    """Whether two tensors are one tensor or views of one base (also under
    Dynamo, which cannot compare storages but knows bases)."""
    return a is b or a._base is b or b._base is a or (a._base is not None and a._base is b._base)


def _check_read_and_mutated(leaf, flat, slots, mutated_positions, plan_index):
    """A tensor passed both read-only and as a declared-mutable argument: the
    read-only one would see the mutation eagerly (where the core reports it
    as undeclared) but not in a compiled graph, which mutates a copy."""
    for m in mutated_positions:
        for kind, pos, _ in slots:
            if kind == _IN_TENSOR and _aliases(flat[pos], flat[m]):
                _refuse_read_and_mutated(leaf, plan_index, pos, m)


@torch._dynamo.assume_constant_result  # raises at trace time
def _refuse_read_and_mutated(leaf, plan_index, read, mutated):
    spec = leaf._plans[plan_index].spec
    read, mutated = leaf._argument_at(spec, read), leaf._argument_at(spec, mutated)
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

# Iterators a compiled call cannot pass on: Dynamo runs them while tracing.
_ITERATORS = (types.GeneratorType, map, filter, zip, enumerate, reversed)


@torch._dynamo.assume_constant_result  # raises at trace time
def _refuse_compiled_argument(leaf, kind, type_name):
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' got a {type_name} argument {_COMPILED_REFUSALS[kind]}"
    )


@torch._dynamo.assume_constant_result
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


def _plain(c):
    """Whether Dynamo can pass ``c`` as a constant (a pytree node's context)."""
    if c is None or type(c) in (bool, int, float, str, bytes, torch.dtype, torch.device) or isinstance(c, type):
        return True
    if type(c) in (tuple, list):
        return all(_plain(x) for x in c)
    return False


def _nest(spec, leaves):
    """Traced by Dynamo: the call's structure as nested tuples of builtins,
    (_NODE, node type, context, children) per pytree node, ``leaves`` at the
    leaves. Dynamo cannot pass a TreeSpec, nor a user object (a registered
    dataclass) rebuilt around markers, to an assume_constant_result function."""
    if spec.is_leaf():
        return next(leaves)
    context = spec.context
    if spec.type not in (tuple, list, dict) and not _plain(context):
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


@torch._dynamo.assume_constant_result
def _intern_for_compile(leaf, skeleton, structures, *objects):
    """Called by Dynamo at trace time only; its result is a graph constant
    (the leaf id among it: reading ``leaf._id`` in the trace would guard on it).
    ``skeleton``: the call's structure from _nest, with _TENSOR, _MODULE,
    _INT markers at the leaves; ``structures``: one per _MODULE; ``objects``:
    one per (_OBJECT, index) leaf."""
    flat = []
    spec = _unnest(leaf, skeleton, flat, skeleton)
    structures = iter(structures)
    key = tuple(
        (_MODULE_KEY, next(structures)) if x is _MODULE
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
    plan = leaf._plan_from_key(spec, key, _COMPILED, _autocast_state(), torch.is_grad_enabled())
    return leaf._id, plan.index, plan.slots, plan.mutated


@torch._dynamo.assume_constant_result
def _positional_call_site(leaf, n):
    """Everything a compiled ``leaf(t1, ..., tn)`` with tensors only needs to
    know at trace time, as one graph constant: (leaf id, plan index, whether
    it takes the order token, whether it stores its own), or None when the
    call takes the general path (declared mutations, export). Dynamo guards
    every global and attribute that traced code reads, on every call of the
    compiled frame; one constant function, and no pytree call or leaf
    attribute read in traced code, keep those guards few."""
    if leaf._mutates_args or torch.compiler.is_exporting():
        return None
    plan = _positional_plan(leaf, n)
    return (leaf._id, plan.index, *_order_decisions(False))


@torch._dynamo.assume_constant_result
def _order_decisions(mutates):
    """(whether the compiled call Dynamo traces now takes the order token,
    whether it stores its own), see _compiled_call."""
    first = _first_ordered_call()  # (also when mutating: it marks the trace)
    # Under a torch.func transform traced by Dynamo (grad, vjp, jacrev) the
    # returned token is wrapped at the transform's level; stored to a global
    # it would be a graph output AOTAutograd cannot read. Calls there are
    # ordered by the token they thread, as inside higher-order operators.
    stores = not _tracing_a_subgraph() and torch._C._functorch.peek_interpreter_stack() is None
    return mutates or not first, stores


def _positional_plan(leaf, n):
    """The compiled plan of ``leaf(t1, ..., tn)`` with tensors only."""
    spec = pytree.tree_structure((tuple(range(n)), {}))
    return leaf._plan_from_key(spec, (_TENSOR,) * n, _COMPILED, _autocast_state(), torch.is_grad_enabled())


@torch._dynamo.assume_constant_result
def _tracing_a_subgraph():
    """Whether Dynamo is tracing the body of a higher-order operator now."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return tx is not None and tx.output.current_tracer.parent is not None


# The Dynamo output graphs (one per trace) in which an ordered call was
# traced, by id, weakly (they are not hashable): trace-time bookkeeping,
# never read at run time.
_ORDERED_TRACES = {}


@torch._dynamo.assume_constant_result
def _first_ordered_call():
    """Whether the compiled call Dynamo traces now is the first of its graph.
    Nothing earlier in the graph needs to run before it (graphs run one after
    another), so it takes no order token: reading ``_ORDER_TOKEN`` makes it a
    graph input with its guards, ~8k instructions on every step. Later calls
    of the graph take the token the previous one returned, a traced value."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return False
    graph, key = tx.output, id(tx.output)
    seen = _ORDERED_TRACES.get(key)
    if seen is not None and seen() is graph:
        return False
    _ORDERED_TRACES[key] = weakref.ref(graph, lambda _, key=key: _ORDERED_TRACES.pop(key, None))
    return True


@torch._dynamo.assume_constant_result
def _traced_output(leaf, plan_index):
    """(output description, checks) of a traced call, where `checks` is what
    traced code checks of its real outputs (_output_checks, read right after
    this trace ran the fake); None for a single tensor with static sizes,
    which traced code returns as it is (no guards on _decode or the checks)."""
    plan = leaf._plans[plan_index]
    if plan.out is _SINGLE and not plan.out_checks:
        return None
    return plan.out, plan.out_checks


def _is_ndarray(x):
    cls = type(x)
    return cls.__name__ == "ndarray" and cls.__module__ == "numpy"


def _tracing_active(tensors):
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    for t in tensors:
        if type(t) is not _Tensor and type(t) is not _Parameter:
            return True
    return False


# ---------------------------------------------------------------- named leaves
# A leaf with a name (@leaf_function(name="ns::op")) is also the operator
# ns::op(Tensor[] inputs, [Tensor(a!)[] mutated,] str call) -> Tensor[]: the
# form in which it is exported. `call` describes the call's structure in
# JSON (pytree spec, constants, which flat arguments are tensors, and the
# module to import), so another process that imports that module can
# rebuild the call; the core turns each distinct description into a plan of
# the leaf bound to the name there (bound_named_ops.h), once.
_CALL_FORMAT = 1
_NAMED: "weakref.WeakValueDictionary[str, LeafFunction]" = weakref.WeakValueDictionary()


def _export_constant(leaf, value, position):
    if value is None or type(value) in (bool, int, float, str):
        return ["const", value]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value).removeprefix("torch.")]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' got a {type(value).__name__} as flat argument "
        f"{position} of an exported call; an exported program stores non-tensor arguments as "
        f"constants, which may be None, bool, int, float, str, torch.dtype or torch.device. Pass "
        f"it as a tensor, or as one of those."
    )


def _import_constant(item):
    kind, value = item
    if kind == "const":
        return value
    if kind == "dtype":
        return getattr(torch, value)
    return torch.device(value)


@torch._dynamo.assume_constant_result
def _describe_for_export(leaf, skeleton):
    """(call description, plan index, flat positions of tensors, flat positions
    of mutated tensors) of an exported call; ``skeleton``: the call's
    arguments with _TENSOR for tensors. A constant of Dynamo's graph when
    export traces with Dynamo (strict mode)."""
    flat, spec = pytree.tree_flatten(skeleton)
    try:
        spec_json = pytree.treespec_dumps(spec)
    except Exception as e:  # e.g. a namedtuple or dataclass without serialization
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' was exported with arguments whose structure "
            f"cannot be saved ({e}). Pass tensors and plain constants in tuples, lists and dicts."
        ) from None
    args = [["tensor"] if x is _TENSOR else _export_constant(leaf, x, i) for i, x in enumerate(flat)]
    call = json.dumps(
        {"torchleaf": _CALL_FORMAT, "leaf": leaf._qualified_name, "import": leaf.__module__,
         "spec": spec_json, "args": args},
        separators=(",", ":"),
    )
    plan = leaf._plan_from_key(spec, tuple(flat), _TRACED)
    tensors = tuple(pos for kind, pos, _ in plan.slots if kind == _IN_TENSOR)
    return call, plan.index, tensors, plan.mutated


def _plan_for_call(leaf_id, call):
    """The core's resolver: the plan of leaf ``leaf_id`` for a call description."""
    try:
        desc = json.loads(call)
        name = desc["leaf"]
        if desc["torchleaf"] != _CALL_FORMAT:
            raise ValueError(f"format {desc['torchleaf']}, expected {_CALL_FORMAT}")
        spec = pytree.treespec_loads(desc["spec"])
        key = tuple(_TENSOR if item[0] == "tensor" else _import_constant(item) for item in desc["args"])
    except Exception as e:
        raise LeafFunctionError(
            f"torchleaf: a named leaf operator received a call description it cannot read ({e}): "
            f"{call!r}. It was written by another torchleaf version or edited; export the program "
            f"again."
        ) from None
    leaf = _NAMED.get(name)
    if leaf is None or leaf._id != leaf_id:
        raise LeafFunctionError(f"torchleaf: leaf function '{name}' is not defined in this process.")
    if spec.num_leaves != len(key):
        raise LeafFunctionError(
            f"torchleaf: leaf function '{name}' received a call description whose structure and "
            f"arguments disagree: {call!r}. Export the program again."
        )
    return leaf._plan_from_key(spec, key, _TRACED).index


def _named_fake(inputs, *rest):
    """The fake of every named Python leaf operator."""
    call = rest[-1]
    mutated = list(rest[0]) if len(rest) == 2 else []
    name = json.loads(call)["leaf"]
    leaf = _NAMED.get(name)
    if leaf is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{name}' is not defined in this process; import the module "
            f"that defines it (@torchleaf.leaf_function(name={name!r})) first."
        )
    from ._registration import _strides_relied_on

    return _C.run_fake(leaf._id, _plan_for_call(leaf._id, call), list(inputs), mutated, _strides_relied_on())


# ------------------------------------------------------------------ decorator
class LeafFunction:
    """A function that tracers treat as one opaque operator call.

    Created by :func:`leaf_function`. Calling it runs the real function on
    real tensors (eagerly, or inside compiled programs) with autograd replayed
    from the function's own graph; tracers run the fake implementation set by
    :meth:`register_fake` instead.
    """

    def __init__(self, fn, mutates_args=(), validate_outputs=None, check_escaped_gradients=None, name=None):
        if isinstance(fn, type) or not callable(fn):
            what = f"the class {fn.__qualname__}" if isinstance(fn, type) else f"a {type(fn).__name__} ({fn!r:.60})"
            raise LeafFunctionError(
                f"torchleaf.leaf_function decorates a function or a method, not {what}. To make a "
                f"module's computation a leaf, decorate the function its forward calls and pass the "
                f"module to it."
            )
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._fake = None
        if name is not None and (not isinstance(name, str) or name.count("::") != 1):
            raise LeafFunctionError(
                f"torchleaf: leaf function '{_function_name(fn)}' got name={name!r}; a leaf's name "
                f"is a qualified operator name \"namespace::name\", e.g. \"mylib::gate\"."
            )
        self._qualified_name = name
        self._named_op = None  # its OpOverloadPacket, for exported calls
        self._name = name or _function_name(fn)
        try:
            self._signature = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none
            self._signature = None
        if isinstance(mutates_args, str):
            mutates_args = (mutates_args,)
        self._mutates_args = frozenset(mutates_args)
        if self._mutates_args and self._signature is None:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{self._name}' declares mutates_args, but Python cannot "
                f"tell its parameters (inspect.signature fails); wrap it in a def with named "
                f"parameters."
            )
        # name -> (parameter, path): a parameter, or an expression into one.
        self._mutated_paths = {e: _parse_mutated_expression(self._name, e) for e in self._mutates_args}
        unknown = {root for root, _ in self._mutated_paths.values()} - set(
            self._signature.parameters if self._signature else ()
        )
        if unknown:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{self._name}' declares mutates_args={sorted(unknown)}, "
                f"which {'is not a parameter' if len(unknown) == 1 else 'are not parameters'}; "
                f"its parameters are {list(self._signature.parameters)}."
            )
        self._plans = {}  # index (a fingerprint of its call structure) -> _Plan
        self._plan_index = {}  # call key -> _Plan
        self._positional = {}  # arity -> _Plan for all-tensor positional calls
        self._output_types = {}  # "module.qualname" -> a type among outputs (_OUT_NAMEDTUPLE, _OUT_TYPED_*)
        self._lock = threading.Lock()
        # The core holds only a weak reference: the leaf dies with its last user.
        self._id = _C.define_python_leaf(
            self._name, _run_real, _run_fake, weakref.ref(self), validate_outputs, check_escaped_gradients,
            _input_name,
        )
        weakref.finalize(self, _C.release_python_leaf, self._id)
        if name is not None:
            _C.bind_named_operator(name, self._id, bool(self._mutates_args), _plan_for_call)
            from ._registration import register_named_python_leaf

            self._named_op = register_named_python_leaf(name, bool(self._mutates_args), _named_fake)
            _NAMED[name] = self
        self._vmap_rule = None  # set by register_vmap
        _functorch.LEAVES[self._id] = self

    def register_vmap(self, rule):
        """Set the leaf's batching rule for ``torch.func.vmap``, with the
        convention of ``torch.library.register_vmap``: ``rule(info, in_dims,
        *args, **kwargs) -> (outputs, out_dims)``, where ``in_dims`` has one
        entry per positional argument (the batch dimension of each tensor, or
        None), ``info.batch_size`` is the batch size, and ``out_dims`` gives
        each output's batch dimension (or one for all). Without a rule a
        leaf runs once per sample and its outputs are stacked. The rule is
        used where no gradient transform runs inside the vmap (``vmap(f)``,
        ``grad(vmap(f))``); ``vmap(grad(f))`` runs the per-sample loop,
        whose backward replays each sample's graph."""
        _functorch.set_vmap_rule(self, rule)
        return rule

    def register_fake(self, fake):
        """Set the fake implementation: same signature, returns outputs with the
        real function's structure, shapes, dtypes and devices (use
        ``torch.empty``/``new_empty``; data-dependent sizes may come from
        ``nonzero()`` or ``torch.library.get_ctx().new_dynamic_size()``).
        Returns the leaf, as PyTorch's built-in ``leaf_function`` does: a fake
        decorated under the leaf's own name (``@f.register_fake`` over
        ``def f``) keeps ``f`` the leaf."""
        self._fake = fake
        return self

    def register_multi_grad_hook(self, hook):
        """Not supported: a clear error where PyTorch's built-in leaf_function
        takes a hook run with the gradients of the call's inputs."""
        raise LeafFunctionError(
            f"torchleaf: leaf function '{self._name}' cannot take a multi-grad hook: "
            f"register_multi_grad_hook of PyTorch's built-in leaf_function is not supported. Call "
            f"torch.autograd.graph.register_multi_grad_hook(inputs, hook) on the inputs that "
            f"require grad where the leaf is called (outside a compiled region), or return the "
            f"values the hook needs as outputs."
        )

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return _BoundLeaf(self, obj)

    def __repr__(self):
        return f"<torchleaf.LeafFunction {self._name}>"

    # Like a function: copied and pickled by reference (a model holding a
    # leaf can be deep-copied, and saved when the leaf is a module global).
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return self.__qualname__

    # -- plans
    def _mutated_positions(self, n, spec):
        if not self._mutates_args:
            return frozenset()
        marked = [object() for _ in range(n)]
        args, kwargs = pytree.tree_unflatten(marked, spec)
        bound = self._signature.bind(*args, **kwargs)
        ids = set()
        for root, path in self._mutated_paths.values():
            if root in bound.arguments:
                value = _follow_mutated_path(self._name, bound.arguments[root], path, marked)
                ids.update(id(x) for x in pytree.tree_leaves(value))
        return frozenset(i for i, m in enumerate(marked) if id(m) in ids)

    def _argument_at(self, spec, pos):
        """The parameter whose value holds flat argument ``pos`` (error messages)."""
        path = self._argument_path(spec, pos)
        return f"flat argument {pos}" if path is None else repr(path)

    def _parameter_name(self, key):
        """The name of positional argument `key` (an int), or keyword `key`;
        None for one the signature does not name (*args, no signature)."""
        if type(key) is not int:
            return key
        params = list(getattr(self._signature, "parameters", {}).values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if key < len(params) and params[key].kind in positional:
            return params[key].name
        return None

    def _argument_path(self, spec, pos):
        """'state["a"]': the parameter whose value holds flat argument ``pos``
        and where in it; None where the call does not match the signature."""
        marked = [object() for _ in range(spec.num_leaves)]
        args, kwargs = pytree.tree_unflatten(marked, spec)
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except (AttributeError, TypeError):  # no signature, or the call does not match it
            bound = {}
        for name, value in bound.items():
            for path, x in pytree.tree_flatten_with_path(value)[0]:
                if x is marked[pos]:
                    return name + pytree.keystr(path)
        return None

    def _plan_from_key(self, spec, key, mode, autocast=None, grad=False):
        """The plan for a call key: per flat argument _TENSOR, a module
        structure tuple (tagged "module"), _INT/_NEGATIVE_INT, or the constant
        itself (traced plans; eager keys hold None for constants). Compiled
        plans also key on the autocast state and the grad mode they were
        traced under."""
        full_key = (mode, spec, key, autocast, grad)
        plan = self._plan_index.get(full_key)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._plan_index.get(full_key)
            if plan is not None:
                return plan
            mutated_positions = self._mutated_positions(len(key), spec)
            template, slots, mutated = [], [], []
            for pos, k in enumerate(key):
                if k is _TENSOR:
                    template.append(None)
                    if pos in mutated_positions:
                        mutated.append(pos)
                    else:
                        slots.append((_IN_TENSOR, pos, None))
                elif type(k) is tuple and len(k) == 2 and k[0] is _MODULE_KEY:
                    template.append(None)
                    kind = _IN_MODULE_MUTABLE_BUFFERS if pos in mutated_positions else _IN_MODULE
                    slots.append((kind, pos, k[1]))
                elif k is _INT or k is _NEGATIVE_INT or k is _SIGNED_INT:
                    template.append(None)
                    kind = _IN_INT if k is _INT else _IN_NEGATIVE_INT if k is _NEGATIVE_INT else _IN_SIGNED_INT
                    slots.append((kind, pos, None))
                elif k is _NDARRAY:
                    template.append(None)
                    slots.append((_IN_NDARRAY, pos, None))
                elif k is _FLOAT:
                    template.append(None)
                    slots.append((_IN_FLOAT, pos, None))
                else:
                    template.append(k)
            positional = (
                len(slots) == len(key) and all(kind == _IN_TENSOR for kind, _, _ in slots)
                and spec == pytree.tree_structure((tuple(range(len(key))), {}))
            )
            index = _fingerprint(full_key)
            while index in self._plans:  # two call structures that print alike
                index = (index + 1) & _FINGERPRINT_MASK
            plan = _Plan(index, spec, tuple(template), tuple(slots), tuple(mutated), mode, positional, autocast, grad)
            self._plans[index] = plan
            self._plan_index[full_key] = plan
            return plan

    def _plan_for(self, flat, spec, traced):
        """(plan, inputs, mutated) for a call's flat arguments."""
        key = []
        module_tensors = []
        handles = []
        views = []
        for x in flat:
            if isinstance(x, _Tensor):
                key.append(_TENSOR)
            elif isinstance(x, nn.Module):
                handle = _own_handle(x)
                if handle is None:  # made on eager calls too: later traces need it
                    view = _ModuleView(x)
                    handle = _handle_of(x, view.structure)
                    handle.view = view
                else:
                    view = _module_view(x, handle)
                key.append((_MODULE_KEY, view.structure))
                module_tensors.append(view.tensors)
                handles.append(handle.tensor)
                views.append((x, view))
            elif traced and _is_ndarray(x):
                key.append(_NDARRAY)
            elif traced:
                try:
                    hash(x)
                except TypeError:
                    raise LeafFunctionError(
                        f"torchleaf: leaf function '{self._name}' got an argument of type "
                        f"{type(x).__name__}, which is not hashable, in a traced call: a traced "
                        f"graph keeps non-tensor arguments as constants. Pass it as a tensor (e.g. "
                        f"torch.as_tensor(x)) or make it hashable."
                    ) from None
                key.append(x)
            else:
                key.append(None)  # eager: the call passes its own constants
        plan = self._plan_from_key(spec, tuple(key), _TRACED if traced else _EAGER)
        inputs = []
        mutable_buffers = []
        modules = iter(module_tensors)
        for kind, pos, structure in plan.slots:
            if kind == _IN_TENSOR:
                inputs.append(flat[pos])
            elif kind == _IN_NDARRAY:
                inputs.append(torch.from_numpy(flat[pos]))
            else:
                _split_module_tensors(kind, structure, next(modules), inputs, mutable_buffers)
        if traced:
            inputs.extend(handles)
        if plan.mutated:
            _check_read_and_mutated(self, flat, plan.slots, plan.mutated, plan.index)
        # An eager call's runner gets the views checked here with the call's
        # own arguments (C++ hands them back to it unchanged).
        arguments = _CheckedArguments(flat, views) if views and not traced else flat
        return plan, inputs, [flat[pos] for pos in plan.mutated] + mutable_buffers, arguments

    # -- calls
    def __call__(self, *args, **kwargs):
        if _is_compiling():
            return self._compiled_call(args, kwargs)
        if not kwargs and not self._mutates_args:
            # Fast path: tensors only, by position.
            for a in args:
                if type(a) is not _Tensor and type(a) is not _Parameter:
                    break
            else:
                plan = self._positional.get(len(args))
                if plan is None:
                    spec = pytree.tree_structure((args, {}))
                    plan = self._positional[len(args)] = self._plan_from_key(
                        spec, (_TENSOR,) * len(args), _EAGER
                    )
                # `()` for arguments: the runner returns this call's own
                # output description (with None it would check it against
                # the plan's, as for a call through the operator, whose
                # outputs carry tensors only), and a call that must go
                # through the operator (a dispatch mode, a functorch
                # transform) returns None and takes the general path.
                result = _C.call(self._id, plan.index, args, (), ())
                if result is not None:
                    outputs, desc = result
                    if desc is _SINGLE:
                        return outputs[0]
                    return _decode(desc, outputs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        for x in flat:
            if isinstance(x, nn.Module):
                with _MODULE_CALLS_LOCK:
                    return self._call_flat(flat, spec)
        return self._call_flat(flat, spec)

    def _call_flat(self, flat, spec):
        tensors = [x for x in flat if isinstance(x, _Tensor)]
        if not _tracing_active(tensors):
            plan, inputs, mutated, arguments = self._plan_for(flat, spec, traced=False)
            result = _C.call(self._id, plan.index, inputs, mutated, arguments)
            if result is not None:
                outputs, desc = result
                return _decode(desc, outputs)
            # Something records the call after all (a functorch transform):
            # describe it for a graph.
        if torch.compiler.is_exporting():
            return self._exported_call(flat, spec)
        self._check_no_sharded_modules(flat)
        plan, inputs, mutated, _ = self._plan_for(flat, spec, traced=True)
        outputs, desc = _C.call(self._id, plan.index, inputs, mutated, None)
        if desc is None:  # through the operator: rebuilt from the traced description
            desc = plan.out
            if plan.out_checks and type(outputs[0]) is not _Tensor:  # a trace (make_fx), not real tensors
                _check_traced_outputs(self, plan.out_checks, outputs)
        return _decode(desc, outputs)

    def _check_no_sharded_modules(self, flat):
        for x in flat:
            if isinstance(x, nn.Module):
                for name, t in itertools.chain(x.named_parameters(), x.named_buffers()):
                    if type(t).__name__ == "DTensor":
                        raise LeafFunctionError(
                            f"torchleaf: leaf function '{self._name}' got a {type(x).__name__} "
                            f"argument whose '{name}' is a sharded DTensor: FSDP gathers a module's "
                            f"parameters in its own forward, which runs inside the leaf, too late. "
                            f"Shard only a parent of the module (fully_shard(model)), or gather it "
                            f"before the call: fully_shard(module, reshard_after_forward=False) and "
                            f"module.unshard() before calling the leaf."
                        )

    def _exported_call(self, flat, spec):
        """A call traced by torch.export (strict or not): the leaf's named
        operator with the call's description."""
        if self._qualified_name is None:
            raise LeafFunctionError(
                f"torchleaf: Python leaf function '{self._name}' cannot be exported without a name: "
                f"an exported program must run in another process, which finds the leaf by its "
                f"operator name. Give it one, @torchleaf.leaf_function(name=\"mylib::op\"), and "
                f"import the module that defines it before torch.export.load; or define the leaf in "
                f"C++ (torchleaf::define_leaf)."
            )
        skeleton = []
        for i, x in enumerate(flat):
            if isinstance(x, _Tensor):
                skeleton.append(_TENSOR)
            elif isinstance(x, nn.Module):
                raise LeafFunctionError(
                    f"torchleaf: leaf function '{self._name}' got a {type(x).__name__} argument in an "
                    f"exported call; an exported program cannot rebuild a module in another process. "
                    f"Pass the tensors the leaf needs (e.g. module.weight) instead."
                )
            else:
                skeleton.append(x)
        call, plan_index, positions, mutated_positions = _describe_for_export(
            self, pytree.tree_unflatten(skeleton, spec)
        )
        inputs = [flat[pos] for pos in positions]
        if self._mutates_args:
            outputs = self._named_op(inputs, [flat[pos] for pos in mutated_positions], call)
        else:
            outputs = self._named_op(inputs, call)
        return self._traced_result(plan_index, outputs)

    def _compiled_call(self, args, kwargs):
        # Traced by Dynamo: everything but the tensors (module tensors and
        # handles included) and carried ints is a graph constant.
        global _ORDER_TOKEN
        if not kwargs:
            n = 0  # (counted here: len() would be one more guarded global)
            for a in args:
                if not isinstance(a, _Tensor):
                    break
                n += 1
            else:
                site = _positional_call_site(self, n)
                if site is not None:
                    # As below (see _ORDER_TOKEN there), without a pytree.
                    leaf_id, plan_index, takes_token, stores_token = site
                    inputs = [*args, _ORDER_TOKEN] if takes_token else [*args]
                    outputs = _CALL(leaf_id, plan_index, inputs)
                    if stores_token:
                        _ORDER_TOKEN = outputs[-1]
                    return self._traced_result(plan_index, outputs)
        if _is_exporting():
            return self._exported_call(*pytree.tree_flatten((args, kwargs)))
        flat = []
        nested = _flatten_traced((args, kwargs), flat)
        skeleton = []
        structures = []
        objects = []
        module_tensors = []
        handles = []
        for x in flat:
            if isinstance(x, _Tensor):
                skeleton.append(_TENSOR)
            elif isinstance(x, nn.Module):
                if _sharded_on_its_own(type(x)):
                    _refuse_compiled_argument(self, "fsdp", type(x).__name__)
                names, aliases, n_params, tensors = _module_state(x)
                cls = type(x)
                skeleton.append(_MODULE)
                structures.append((cls.__module__, cls.__qualname__, names, aliases, n_params))
                module_tensors.append(tensors)
                handle = x.__dict__.get(_HANDLE_ATTR)
                if type(handle) is not _ModuleHandle:  # none yet, or unpickled
                    handles.append(torch.full((), _sight_module(x), dtype=torch.int64))
                else:
                    handles.append(handle.tensor)
            elif type(x) is int:
                # Not bool or IntEnum (those stay constants). May be
                # symbolic: its value reaches the function through a
                # carrier's size instead of a graph constant.
                skeleton.append(_carried_int(x))
            elif type(x) is float:  # Dynamo makes changing floats symbolic
                skeleton.append(_FLOAT)
            elif _is_ndarray(x):  # Dynamo holds arrays as tensors
                skeleton.append(_NDARRAY)
            elif _plain(x):
                skeleton.append(x)
            elif isinstance(x, _ITERATORS):
                _refuse_compiled_argument(self, "iterator", type(x).__name__)
            else:
                # Any other object (an enum, a config object): Dynamo passes it
                # to a constant function as an argument of its own (guarded on
                # its identity), not inside the skeleton.
                skeleton.append((_OBJECT, len(objects)))
                objects.append(x)
        leaf_id, plan_index, slots, mutated_positions = _intern_for_compile(
            self, _fill(nested, iter(skeleton)), tuple(structures), *objects
        )
        if mutated_positions:
            _check_read_and_mutated(self, flat, slots, mutated_positions, plan_index)
        inputs = []
        mutable_buffers = []
        module_index = 0
        for kind, pos, structure in slots:
            if kind in _MODULE_KINDS:
                _split_module_tensors(kind, structure, module_tensors[module_index], inputs, mutable_buffers)
                module_index += 1
            elif kind == _IN_TENSOR:
                inputs.append(flat[pos])
            elif kind == _IN_NDARRAY:
                inputs.append(torch.as_tensor(flat[pos]))
            elif kind == _IN_FLOAT:
                # (An addition, not torch.scalar_tensor: Dynamo keeps a float that
                # feeds arithmetic symbolic, and specialized the other.)
                inputs.append(torch.zeros((), dtype=torch.float64) + flat[pos])
            else:  # a zero-stride carrier: no memory, size = the int
                n = flat[pos]
                if kind == _IN_SIGNED_INT:
                    size = torch.sym_max(2 * n, -2 * n - 1)  # zigzag, unguarded
                else:
                    size = n if kind == _IN_INT else -n
                inputs.append(torch.empty(()).expand(size))
        inputs.extend(handles)
        # Order: each compiled call takes the token the previous one returned,
        # and the last one's is stored back (a graph output), so calls run in
        # program order and none is dead code, whatever their outputs' use.
        # The first call of a graph takes none (_first_ordered_call), unless
        # it mutates: the token then comes before the mutated tensors, and
        # _Plan.rebuild tells it only when it is the last input.
        # Inside a higher-order operator's body (activation checkpointing,
        # torch.cond) Dynamo refuses stores to outside state: there calls
        # take the token but return theirs unused, ordered by graph order.
        mutated = [flat[pos] for pos in mutated_positions] + mutable_buffers
        takes_token, stores_token = _order_decisions(bool(mutated))
        if takes_token:
            inputs.append(_ORDER_TOKEN)
        if mutated:
            outputs = _CALL_MUTATING(leaf_id, plan_index, inputs, mutated)
        else:
            outputs = _CALL(leaf_id, plan_index, inputs)
        if stores_token:
            _ORDER_TOKEN = outputs[-1]
        return self._traced_result(plan_index, outputs)

    def _traced_result(self, plan_index, outputs):
        """What a compiled or exported call returns, from its operator's
        outputs (a compiled call's order token last, which no description
        names): the traced description's outputs, checked where the graph
        takes ints or sizes from the fake (_check_traced_outputs)."""
        traced = _traced_output(self, plan_index)
        if traced is None:
            return outputs[0]
        desc, checks = traced
        if checks:
            _check_traced_outputs(self, checks, outputs)
        return _decode(desc, outputs, self._output_types)


def _carried_int(x):
    """How a compiled call passes the int ``x`` (traced by Dynamo): as a
    carrier's size when its sign is known (_INT, _NEGATIVE_INT), zigzag-coded
    when the trace cannot know it without a data-dependent guard (an unbacked
    int from ``.item()``: _SIGNED_INT), or as itself, a graph constant,
    beyond a size's range (seeds, hashes: Dynamo keeps those constant)."""
    if guard_or_false(x > _MAX_CARRIED_INT) or guard_or_false(x < -_MAX_CARRIED_INT):
        return x
    if guard_or_false(x >= 0):
        return _INT
    if guard_or_false(x < 0):
        return _NEGATIVE_INT
    return _SIGNED_INT


def _function_name(fn):
    """'module.qualname' of a function, a builtin or a functools.partial."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    module = getattr(target, "__module__", None) or type(target).__module__
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    return f"{module}.{name}" + (" (partial)" if target is not fn else "")


_MUTATED_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(-?\d+)\]|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")


def _parse_mutated_expression(leaf_name, expr):
    """``'buf'``, ``'state["key"]'``, ``'buffers[0]'``, ``'model.running_mean'``
    (the expressions PyTorch's built-in leaf_function takes) -> (parameter,
    steps), each step ("attr", name) or ("item", key)."""
    root = re.match(r"[A-Za-z_]\w*", expr)
    steps, pos = [], root.end() if root else 0
    while root and pos < len(expr):
        m = _MUTATED_STEP.match(expr, pos)
        if m is None:
            break
        attr, index, quoted = m.groups()
        steps.append(("attr", attr) if attr else ("item", int(index) if index is not None else ast.literal_eval(quoted)))
        pos = m.end()
    if root is None or pos != len(expr):
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf_name}' declares mutates_args entry {expr!r}, which "
            f"is not a parameter name or an expression into one ('buf', 'buffers[0]', "
            f"'state[\"key\"]', 'model.running_mean')."
        )
    return root.group(0), tuple(steps)


def _follow_mutated_path(leaf_name, value, path, flat_markers):
    """What a mutates_args expression names in a call's arguments, whose
    flat leaves are markers. A path that goes on into a flat leaf (a module's
    buffer: 'model.running_mean') names that leaf: a module named in
    mutates_args may change any of its buffers."""
    for kind, key in path:
        if any(value is m for m in flat_markers):
            return value
        try:
            if kind == "item" and isinstance(value, dict) and key not in value:
                raise KeyError(key)  # (a defaultdict would make the entry)
            value = getattr(value, key) if kind == "attr" else value[key]
        except (AttributeError, LookupError, TypeError):
            step = f".{key}" if kind == "attr" else f"[{key!r}]"
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf_name}' declares a mutates_args expression whose "
                f"step {step} does not exist in this call's arguments (a {type(value).__name__})."
            ) from None
    return value


class _BoundLeaf:
    """A leaf used as a method, bound to its instance (a plain callable
    object: Dynamo traces its call, where it cannot call a bound
    types.MethodType of a LeafFunction)."""

    __slots__ = ("__self__", "__func__")

    def __init__(self, leaf, obj):
        self.__func__ = leaf
        self.__self__ = obj

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def register_fake(self, fake):
        """``obj.method.register_fake``: the leaf's own (LeafFunction.register_fake)."""
        return self.__func__.register_fake(fake)

    def register_multi_grad_hook(self, hook):
        """The leaf's own: a clear error (LeafFunction.register_multi_grad_hook)."""
        return self.__func__.register_multi_grad_hook(hook)

    def __repr__(self):
        return f"<bound leaf function {self.__func__._name} of {self.__self__!r}>"


def leaf_function(fn=None, *, mutates_args=(), validate_outputs=None, check_escaped_gradients=None, name=None):
    """Make ``fn`` a leaf function: opaque to torch.compile, make_fx, AOTAutograd
    and export; run for real on every call; differentiable without a
    hand-written backward.

    Use as ``@leaf_function`` or ``@leaf_function(mutates_args={"buf"})``, then
    give it a fake implementation with ``@fn.register_fake``.

    Args:
        mutates_args: names of parameters whose tensors the function mutates
            in place (they must not require grad), or expressions into them
            as PyTorch's built-in leaf_function takes: ``"buffers[0]"``,
            ``'state["key"]'``, ``"model.running_mean"`` (a path into a module
            declares its buffers).
        validate_outputs, check_escaped_gradients: per-leaf overrides of the
            flags in :mod:`torchleaf.config`.
        name: ``"namespace::name"``: the leaf is also the operator
            ``torch.ops.namespace.name``, and ``torch.export`` records its
            calls as that operator; a process that loads the exported program
            must import the module that defines the leaf first.
    """

    def wrap(f):
        return LeafFunction(
            f,
            mutates_args=mutates_args,
            validate_outputs=validate_outputs,
            check_escaped_gradients=check_escaped_gradients,
            name=name,
        )

    return wrap if fn is None else wrap(fn)
