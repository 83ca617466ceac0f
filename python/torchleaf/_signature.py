"""A leaf function's signature: its parameters, its declared mutations
(``mutates_args``, parsed here), its static arguments, and the names of its
arguments in error messages.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

import torch

from ._errors import LeafFunctionError
from ._torch_private import pytree

_Tensor = torch.Tensor

# ----------------------------------------------------------- mutates_args
_MUTATED_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(-?\d+)\]|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")


def parse_mutated_expression(leaf_name, expr):
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


class Signature:
    """A leaf function's parameters, its declared mutations, and the names
    of its arguments in error messages."""

    def __init__(self, name: str, fn, mutates_args, static_argnames=()):
        self.name = name
        self.parameters: Any  # an inspect.Signature, or None (some builtins have none)
        try:
            self.parameters = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none
            self.parameters = None
        if isinstance(mutates_args, str):
            mutates_args = (mutates_args,)
        self.mutates_args = frozenset(mutates_args)
        if self.mutates_args and self.parameters is None:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{name}' declares mutates_args, but Python cannot "
                f"tell its parameters (inspect.signature fails); wrap it in a def with named "
                f"parameters."
            )
        # name -> (parameter, path): a parameter, or an expression into one.
        self.mutated_paths = {e: parse_mutated_expression(name, e) for e in self.mutates_args}
        unknown = {root for root, _ in self.mutated_paths.values()} - set(
            self.parameters.parameters if self.parameters else ()
        )
        if unknown:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{name}' declares mutates_args={sorted(unknown)}, "
                f"which {'is not a parameter' if len(unknown) == 1 else 'are not parameters'}; "
                f"its parameters are {list(self.parameters.parameters)}."
            )
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        self.static_argnames = frozenset(static_argnames)
        unknown = set(self.static_argnames) - set(self.parameters.parameters if self.parameters else ())
        if unknown:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{name}' declares static_argnames={sorted(unknown)}, "
                f"which {'is not a parameter' if len(unknown) == 1 else 'are not parameters'}; "
                f"its parameters are {list(self.parameters.parameters) if self.parameters else []}."
            )
        # Positional parameter names in order (static_positions).
        params = list(self.parameters.parameters.values()) if self.parameters is not None else []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._positional_names = tuple(p.name for p in params if p.kind in positional)

    def static_positions(self, n_args: int, kwarg_names, leaves_per_argument) -> frozenset:
        """The flat positions of a call's arguments that static_argnames
        names: ``n_args`` positional arguments and ``kwarg_names``, holding
        ``leaves_per_argument`` flat leaves each, in that order."""
        static: set[int] = set()
        start = 0
        names = [self._positional_names[i] if i < len(self._positional_names) else None for i in range(n_args)]
        for name, n in zip([*names, *kwarg_names], leaves_per_argument):
            if name in self.static_argnames:
                static.update(range(start, start + n))
            start += n
        return frozenset(static)

    def tensor_defaults(self) -> tuple:
        """(name, default) of each parameter whose default is a tensor and
        that a call may pass by keyword."""
        params = self.parameters.parameters.values() if self.parameters is not None else ()
        return tuple(
            (p.name, p.default)
            for p in params
            if isinstance(p.default, _Tensor) and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )

    def mutated_positions(self, n: int, spec) -> frozenset:
        """The flat positions of a call's arguments that mutates_args names."""
        if not self.mutates_args:
            return frozenset()
        marked = [object() for _ in range(n)]
        args, kwargs = pytree.tree_unflatten(marked, spec)
        bound = self.parameters.bind(*args, **kwargs)
        ids: set[int] = set()
        for root, path in self.mutated_paths.values():
            if root in bound.arguments:
                value = _follow_mutated_path(self.name, bound.arguments[root], path, marked)
                ids.update(id(x) for x in pytree.tree_leaves(value))
        return frozenset(i for i, m in enumerate(marked) if id(m) in ids)

    def argument_at(self, spec, pos: int) -> str:
        """The parameter whose value holds flat argument ``pos`` (error messages)."""
        path = self.argument_path(spec, pos)
        return f"flat argument {pos}" if path is None else repr(path)

    def parameter_name(self, key):
        """The name of positional argument `key` (an int), or keyword `key`;
        None for one the signature does not name (*args, no signature)."""
        if type(key) is not int:
            return key
        params = list(getattr(self.parameters, "parameters", {}).values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if key < len(params) and params[key].kind in positional:
            return params[key].name
        return None

    def argument_path(self, spec, pos: int):
        """'state["a"]': the parameter whose value holds flat argument ``pos``
        and where in it; None where the call does not match the signature."""
        marked = [object() for _ in range(spec.num_leaves)]
        args, kwargs = pytree.tree_unflatten(marked, spec)
        try:
            bound = self.parameters.bind(*args, **kwargs).arguments
        except (AttributeError, TypeError):  # no signature, or the call does not match it
            bound = {}
        for name, value in bound.items():
            for path, x in pytree.tree_flatten_with_path(value)[0]:
                if x is marked[pos]:
                    return name + pytree.keystr(path)
        return None
