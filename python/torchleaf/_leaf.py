"""The ``@leaf_function`` decorator: Python leaf functions on the C++ core.

A call is flattened into tensors (the operator's inputs) and a ``_Call`` that
says how to rebuild the user's arguments from them (the pytree spec, the
constants, nn.Module slots, which tensors are declared mutable). Each distinct
``_Call`` is registered once with the core as its own leaf id, so the operator
``torchleaf::call(id, inputs, mutated)`` is self-describing: traced graphs can
run it later without any Python-side context. Only calls whose constants keep
changing (beyond ``_MAX_CALLS_PER_LEAF``) pass their ``_Call`` per call
instead, through the leaf's base id.
"""

import contextlib
import functools
import inspect
import types

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from . import _C
from ._errors import LeafFunctionError

_Tensor = torch.Tensor
_TENSOR = "\x00torchleaf:tensor"  # stands for a tensor in a call's skeleton
_MODULE = "\x00torchleaf:module"  # stands for an nn.Module in a call's skeleton
# Stand for an int that a compiled program passes as the size of a carrier
# tensor, so that it may stay symbolic (Dynamo makes a changing int dynamic).
_INT = "\x00torchleaf:int"
_NEGATIVE_INT = "\x00torchleaf:-int"

# Kinds of operator inputs in a _Call's order.
_IN_TENSOR, _IN_MODULE, _IN_INT, _IN_NEGATIVE_INT = range(4)
_MAX_CALLS_PER_LEAF = 256

# Leaf id -> _Call, for every registered call description.
_CALLS: dict = {}


def _module_state(module):
    names, tensors = [], []
    for name, p in module.named_parameters():
        names.append(name)
        tensors.append(p)
    for name, b in module.named_buffers():
        names.append(name)
        tensors.append(b)
    return tuple(names), tensors


# --------------------------------------------------------------------- outputs
# Outputs are described by a small nested tuple of constants, so that Dynamo
# can rebuild them from a constant (it cannot use a TreeSpec constant).
_OUT_TENSOR, _OUT_TUPLE, _OUT_LIST, _OUT_DICT, _OUT_CONST, _OUT_NAMEDTUPLE = range(6)
_SINGLE = (_OUT_TENSOR, 0)


def _encode(leaf, obj, tensors):
    if isinstance(obj, _Tensor):
        tensors.append(obj)
        return (_OUT_TENSOR, len(tensors) - 1)
    if isinstance(obj, tuple):
        children = tuple(_encode(leaf, x, tensors) for x in obj)
        if hasattr(obj, "_fields"):
            return (_OUT_NAMEDTUPLE, type(obj), children)
        return (_OUT_TUPLE, children)
    if isinstance(obj, list):
        return (_OUT_LIST, tuple(_encode(leaf, x, tensors) for x in obj))
    if isinstance(obj, dict):
        return (_OUT_DICT, tuple(obj.keys()), tuple(_encode(leaf, x, tensors) for x in obj.values()))
    if type(obj) in pytree.SUPPORTED_NODES:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' returned a {type(obj).__name__}; leaf outputs "
            f"may be tensors, constants and tuples, lists, dicts or namedtuples of them."
        )
    return (_OUT_CONST, obj)


def _decode(desc, tensors):
    kind = desc[0]
    if kind == _OUT_TENSOR:
        return tensors[desc[1]]
    if kind == _OUT_TUPLE:
        return tuple(_decode(d, tensors) for d in desc[1])
    if kind == _OUT_LIST:
        return [_decode(d, tensors) for d in desc[1]]
    if kind == _OUT_DICT:
        return dict(zip(desc[1], [_decode(d, tensors) for d in desc[2]]))
    if kind == _OUT_NAMEDTUPLE:
        return desc[1](*[_decode(d, tensors) for d in desc[2]])
    return desc[1]


def _structure(desc):
    """The shape of a description without constant values (for validation)."""
    kind = desc[0]
    if kind == _OUT_TENSOR:
        return kind
    if kind == _OUT_CONST:
        return (kind, type(desc[1]))
    if kind == _OUT_DICT:
        return (kind, desc[1], tuple(_structure(d) for d in desc[2]))
    if kind == _OUT_NAMEDTUPLE:
        return (kind, desc[1], tuple(_structure(d) for d in desc[2]))
    return (kind, tuple(_structure(d) for d in desc[1]))


def _flatten_output(leaf, out):
    if isinstance(out, _Tensor):
        return [out], _SINGLE
    tensors = []
    return tensors, _encode(leaf, out, tensors)


# ----------------------------------------------------------------------- calls
class _Call:
    """How to rebuild one call's arguments from the operator's tensors.

    The operator receives ``inputs`` (tensor leaves and module parameters and
    buffers, in flattening order) and ``mutated`` (tensor leaves of
    parameters named in ``mutates_args``).
    """

    __slots__ = ("leaf", "spec", "template", "order", "mutated_slots", "modules", "out", "id", "positional")

    def __init__(self, leaf, flat, spec, modules):
        self.leaf = leaf
        self.spec = spec
        self.template = list(flat)
        self.order = []  # (input kind, flat position) per input group
        self.modules = []  # (module, parameter and buffer names)
        mutated_positions = leaf._mutated_positions(flat, spec)
        self.mutated_slots = []
        module_iter = iter(modules)
        for i, x in enumerate(flat):
            if x is _TENSOR or isinstance(x, _Tensor):
                self.template[i] = None
                if i in mutated_positions:
                    self.mutated_slots.append(i)
                else:
                    self.order.append((_IN_TENSOR, i))
            elif x is _MODULE or isinstance(x, nn.Module):
                module = next(module_iter)
                self.template[i] = module
                self.modules.append((module, _module_state(module)[0]))
                self.order.append((_IN_MODULE, i))
            elif x is _INT or x is _NEGATIVE_INT:
                self.template[i] = None
                self.order.append((_IN_INT if x is _INT else _IN_NEGATIVE_INT, i))
        self.order = tuple(self.order)
        self.mutated_slots = tuple(self.mutated_slots)
        self.out = None  # the fake's output description, once traced
        self.id = None
        # Tensors only, by position: the function takes the operator's inputs as they are.
        self.positional = (
            all(kind == _IN_TENSOR for kind, _ in self.order)
            and not self.mutated_slots and None not in flat
            and all(t is None for t in self.template) and spec == pytree.tree_structure((tuple(flat), {}))
        )

    def invoke(self, fn, tensors):
        flat = list(self.template)
        k = 0
        bindings = []
        module_index = 0
        for kind, pos in self.order:
            if kind == _IN_MODULE:
                module, names = self.modules[module_index]
                module_index += 1
                bindings.append((module, dict(zip(names, tensors[k : k + len(names)]))))
                k += len(names)
                continue
            if kind == _IN_TENSOR:
                flat[pos] = tensors[k]
            else:  # an int carried as a size
                size = tensors[k].shape[0]
                flat[pos] = size if kind == _IN_INT else -size
            k += 1
        for pos in self.mutated_slots:
            flat[pos] = tensors[k]
            k += 1
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        if not bindings:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for module, mapping in bindings:
                stack.enter_context(_reparametrize_module(module, mapping, tie_weights=False, strict=True))
            out = fn(*args, **kwargs)
            for module, mapping in bindings:
                current = dict(module.named_parameters())
                current.update(module.named_buffers())
                for name, tensor in mapping.items():
                    if current.get(name) is not tensor:
                        raise LeafFunctionError(
                            f"torchleaf: leaf function '{self.leaf._name}' replaced '{name}' of its "
                            f"{type(module).__name__} argument. The module's parameters and buffers "
                            f"are the leaf's inputs and must not be reassigned inside it; return the "
                            f"new value instead."
                        )
            return out

    def split(self, flat, module_tensors):
        """The operator's (inputs, mutated) lists for the flat leaves of a call."""
        inputs = []
        module_index = 0
        for kind, pos in self.order:  # eager calls never carry ints
            if kind == _IN_MODULE:
                inputs.extend(module_tensors[module_index])
                module_index += 1
            else:
                inputs.append(flat[pos])
        return inputs, [flat[pos] for pos in self.mutated_slots]


def _register_call(call):
    leaf = call.leaf
    call.id = _C.define_python_leaf(
        leaf._name, _run_real, _run_fake, call, leaf._validate_outputs, leaf._check_escaped_gradients
    )
    _CALLS[call.id] = call
    return call.id


def _run_real(tensors, call):
    """Trampoline target: run the user's function for one call; returns the
    output tensors and the output description."""
    leaf = call.leaf
    try:
        out = leaf._fn(*tensors) if call.positional else call.invoke(leaf._fn, tensors)
    except BaseException as e:
        _add_note(e, f"raised inside the real function of leaf function '{leaf._name}'")
        raise
    if type(out) is _Tensor:
        flat, desc = [out], _SINGLE
    else:
        flat, desc = _flatten_output(leaf, out)
    traced = call.out
    if traced is not None and traced is not desc and _structure(traced) != _structure(desc):
        # A compiled graph expects the fake's outputs.
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' returned a different output structure than "
            f"its fake implementation.\n  real: {_show(desc)}\n  fake: {_show(traced)}\n"
            f"Make the fake return the same pytree structure as the real function."
        )
    return flat, desc


def _run_fake(tensors, call, real_desc=None):
    """Trampoline target, and the Python fake of torchleaf::call: run the fake.
    ``real_desc``: the real call's output description, when validating it."""
    leaf = call.leaf
    if leaf._fake is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' requires a fake implementation to be traced "
            f"(torch.compile, make_fx, torch.export, fake tensors) or validated. Register one with "
            f"@{leaf.__name__}.register_fake; it must return outputs with the same structure, "
            f"shapes and dtypes as the real function."
        )
    try:
        out = call.invoke(leaf._fake, tensors)
    except BaseException as e:
        _add_note(e, f"raised inside the fake implementation of leaf function '{leaf._name}'")
        raise
    flat, desc = _flatten_output(leaf, out)
    _check_constants(leaf, desc)
    if real_desc is not None and _structure(real_desc) != _structure(desc):
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' returned a different output structure "
            f"than its fake implementation.\n  real: {_show(real_desc)}\n  fake: {_show(desc)}\n"
            f"Make the fake return the same pytree structure as the real function."
        )
    call.out = desc
    return flat


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _check_constants(leaf, desc):
    """A fake's non-tensor outputs become graph constants: only plain values."""
    kind = desc[0]
    if kind == _OUT_CONST:
        if not isinstance(desc[1], _CONSTANT_TYPES):
            raise LeafFunctionError(
                f"torchleaf: the fake implementation of leaf function '{leaf._name}' returned a "
                f"{type(desc[1]).__name__} where a tensor or a plain constant (None, bool, int, "
                f"float, str) was expected. Return tensors (e.g. torch.empty(...)) for array outputs."
            )
    elif kind == _OUT_DICT or kind == _OUT_NAMEDTUPLE:
        for d in desc[2]:
            _check_constants(leaf, d)
    elif kind != _OUT_TENSOR:
        for d in desc[1]:
            _check_constants(leaf, d)


def _show(desc):
    kind = desc[0]
    if kind == _OUT_TENSOR:
        return "Tensor"
    if kind == _OUT_CONST:
        return repr(desc[1])
    if kind == _OUT_DICT:
        return "{" + ", ".join(f"{k!r}: {_show(d)}" for k, d in zip(desc[1], desc[2])) + "}"
    if kind == _OUT_NAMEDTUPLE:
        return desc[1].__name__ + "(" + ", ".join(_show(d) for d in desc[2]) + ")"
    inner = ", ".join(_show(d) for d in desc[1])
    return f"({inner})" if kind == _OUT_TUPLE else f"[{inner}]"


def _add_note(e, note):
    notes = getattr(e, "__notes__", ())
    if note not in notes and hasattr(e, "add_note"):
        e.add_note(note)


# ---------------------------------------------------------------- compilation
@torch._dynamo.assume_constant_result
def _intern_for_compile(leaf, skeleton, *modules):
    """Called by Dynamo at trace time only; its result is a graph constant."""
    flat, spec = pytree.tree_flatten(skeleton)
    call = leaf._lookup_call(flat, spec, modules, tracing=True)
    return call.id, call.order, call.mutated_slots


@torch._dynamo.assume_constant_result
def _traced_output(call_id):
    call = _CALLS[call_id]
    if call.out is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{call.leaf._name}' was traced without running its fake "
            f"implementation; this is a torchleaf bug."
        )
    return call.out


def _tracing_active(tensors):
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    for t in tensors:
        if type(t) is not _Tensor and type(t) is not nn.Parameter:
            return True
    return False


# ------------------------------------------------------------------ decorator
class LeafFunction:
    """A function that tracers treat as one opaque operator call.

    Created by :func:`leaf_function`. Calling it runs the real function on
    real tensors (eagerly, or inside compiled programs) with autograd replayed
    from the function's own graph; tracers run the fake implementation set by
    :meth:`register_fake` instead.
    """

    def __init__(self, fn, mutates_args=(), validate_outputs=None, check_escaped_gradients=None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._fake = None
        self._name = f"{fn.__module__}.{fn.__qualname__}"
        self._validate_outputs = validate_outputs
        self._check_escaped_gradients = check_escaped_gradients
        self._signature = inspect.signature(fn)
        if isinstance(mutates_args, str):
            mutates_args = (mutates_args,)
        self._mutates_args = frozenset(mutates_args)
        unknown = self._mutates_args - set(self._signature.parameters)
        if unknown:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{self._name}' declares mutates_args={sorted(unknown)}, "
                f"which {'is not a parameter' if len(unknown) == 1 else 'are not parameters'}; "
                f"its parameters are {list(self._signature.parameters)}."
            )
        self._calls = {}  # call key -> _Call
        self._positional = {}  # arity -> _Call for all-tensor positional calls
        # Base id: calls that pass their _Call per call (see module docstring).
        self._base_id = _C.define_python_leaf(
            self._name, _run_real, _run_fake, None, validate_outputs, check_escaped_gradients
        )

    def register_fake(self, fake):
        """Set the fake implementation: same signature, returns outputs with the
        real function's structure, shapes, dtypes and devices (use
        ``torch.empty``/``new_empty``; data-dependent sizes may come from
        ``nonzero()`` or ``torch.library.get_ctx().new_dynamic_size()``)."""
        self._fake = fake
        return fake

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return types.MethodType(self, obj)

    def __repr__(self):
        return f"<torchleaf.LeafFunction {self._name}>"

    # -- calls
    def _mutated_positions(self, flat, spec):
        if not self._mutates_args:
            return frozenset()
        marked = [object() for _ in flat]
        args, kwargs = pytree.tree_unflatten(marked, spec)
        bound = self._signature.bind(*args, **kwargs)
        ids = set()
        for name in self._mutates_args:
            if name in bound.arguments:
                ids.update(id(x) for x in pytree.tree_leaves(bound.arguments[name]))
        return frozenset(i for i, m in enumerate(marked) if id(m) in ids)

    def _lookup_call(self, flat, spec, modules, tracing):
        key = [spec]
        module_iter = iter(modules)
        for x in flat:
            if x is _TENSOR or isinstance(x, _Tensor):
                key.append(_TENSOR)
            elif x is _MODULE or isinstance(x, nn.Module):
                module = next(module_iter)
                key.append((_MODULE, id(module), _module_state(module)[0]))
            else:
                key.append(x)
        try:
            key = tuple(key)
            call = self._calls.get(key)
        except TypeError:  # unhashable constants: describe the call afresh
            key, call = None, None
        if call is not None:
            return call
        call = _Call(self, flat, spec, modules)
        if tracing or (key is not None and len(self._calls) < _MAX_CALLS_PER_LEAF):
            _register_call(call)
            if key is not None:
                self._calls[key] = call
        return call

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self._compiled_call(args, kwargs)
        if not kwargs and not self._mutates_args:
            # Fast path: tensors only, by position.
            for a in args:
                if type(a) is not _Tensor and type(a) is not nn.Parameter:
                    break
            else:
                call = self._positional.get(len(args))
                if call is None:
                    flat, spec = pytree.tree_flatten((args, {}))
                    call = self._positional[len(args)] = self._lookup_call(flat, spec, (), tracing=True)
                outputs, desc = _C.call(call.id, args, (), None)
                if desc is _SINGLE:
                    return outputs[0]
                return _decode(desc if desc is not None else call.out, outputs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        modules = [x for x in flat if isinstance(x, nn.Module)]
        module_tensors = [_module_state(m)[1] for m in modules]
        tensors = [x for x in flat if isinstance(x, _Tensor)]
        for ts in module_tensors:
            tensors.extend(ts)
        tracing = _tracing_active(tensors)
        if tracing:
            self._check_not_exporting()
        call = self._lookup_call(flat, spec, modules, tracing)
        inputs, mutated = call.split(flat, module_tensors)
        if call.id is not None:
            return self._finish(call, _C.call(call.id, inputs, mutated, None))
        return self._finish(call, _C.call(self._base_id, inputs, mutated, call))

    @staticmethod
    def _finish(call, result):
        outputs, desc = result
        if desc is None:  # traced: the fake described the outputs
            desc = call.out
        return _decode(desc, outputs)

    def _check_not_exporting(self):
        if torch.compiler.is_exporting():
            raise LeafFunctionError(
                f"torchleaf: Python leaf function '{self._name}' cannot be exported: an exported "
                f"program must run in another process, and a Python function cannot be saved into "
                f"it. Define the leaf in C++ (torchleaf::define_leaf), which exports as its named "
                f"operator, or call it outside the exported module."
            )

    def _compiled_call(self, args, kwargs):
        # Traced by Dynamo: everything but the operator call is constant.
        self._check_not_exporting()
        flat, spec = pytree.tree_flatten((args, kwargs))
        skeleton = []
        modules = []
        module_tensors = []
        for x in flat:
            if isinstance(x, _Tensor):
                skeleton.append(_TENSOR)
            elif isinstance(x, nn.Module):
                skeleton.append(_MODULE)
                modules.append(x)
                module_tensors.append(
                    [p for _, p in x.named_parameters()] + [b for _, b in x.named_buffers()]
                )
            elif type(x) is int:  # not bool or IntEnum: those stay constants
                # May be symbolic: its value reaches the function through a
                # carrier's size instead of a graph constant.
                skeleton.append(_INT if x >= 0 else _NEGATIVE_INT)
            else:
                skeleton.append(x)
        call_id, order, mutated_slots = _intern_for_compile(self, pytree.tree_unflatten(skeleton, spec), *modules)
        inputs = []
        module_index = 0
        for kind, pos in order:
            if kind == _IN_MODULE:
                inputs.extend(module_tensors[module_index])
                module_index += 1
            elif kind == _IN_TENSOR:
                inputs.append(flat[pos])
            else:  # a zero-stride carrier: no memory, size = the int
                size = flat[pos] if kind == _IN_INT else -flat[pos]
                inputs.append(torch.empty(()).expand(size))
        mutated = [flat[pos] for pos in mutated_slots]
        if mutated:
            outputs = torch.ops.torchleaf.call_mutating(call_id, inputs, mutated)
        else:
            outputs = torch.ops.torchleaf.call(call_id, inputs)
        return _decode(_traced_output(call_id), outputs)


def leaf_function(fn=None, *, mutates_args=(), validate_outputs=None, check_escaped_gradients=None):
    """Make ``fn`` a leaf function: opaque to torch.compile, make_fx, AOTAutograd
    and export; run for real on every call; differentiable without a
    hand-written backward.

    Use as ``@leaf_function`` or ``@leaf_function(mutates_args={"buf"})``, then
    give it a fake implementation with ``@fn.register_fake``.

    Args:
        mutates_args: names of parameters whose tensors the function mutates
            in place (they must not require grad).
        validate_outputs, check_escaped_gradients: per-leaf overrides of the
            flags in :mod:`torchleaf.config`.
    """

    def wrap(f):
        return LeafFunction(
            f,
            mutates_args=mutates_args,
            validate_outputs=validate_outputs,
            check_escaped_gradients=check_escaped_gradients,
        )

    return wrap if fn is None else wrap(fn)
