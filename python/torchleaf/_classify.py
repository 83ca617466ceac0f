"""What a call's argument is: the one classifier of flat arguments
(:func:`classify`), and the modes a call is made in, which it depends on.
Eager and traced calls (_leaf.py), compiled calls (_dynamo.py) and exported
ones (_export.py) ask it; nothing else decides.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_Tensor = torch.Tensor


# How a plan's calls are made: eagerly (arguments passed along), traced by
# make_fx or fake tensors (constants baked in), compiled by Dynamo (also
# ordered by a token), or exported (the leaf's named operator).
EAGER, TRACED, COMPILED, EXPORTED = range(4)

# ------------------------------------------------------------ the classifier
# What one flat argument of a call is (classify).
TENSOR_ARG, MODULE_ARG, NDARRAY_ARG, INT_ARG, FLOAT_ARG, CONSTANT_ARG, OBJECT_ARG, ITERATOR_ARG = range(8)

# Iterators a compiled call cannot pass on: Dynamo runs them while tracing.
ITERATORS = (types.GeneratorType, map, filter, zip, enumerate, reversed)


def is_ndarray(x) -> bool:
    cls = type(x)
    return cls.__name__ == "ndarray" and cls.__module__ == "numpy"


def plain(c) -> bool:
    """Whether Dynamo can pass ``c`` as a constant (an argument, or a pytree
    node's context)."""
    if c is None or type(c) in (bool, int, float, str, bytes, torch.dtype, torch.device) or isinstance(c, type):
        return True
    if type(c) in (tuple, list):
        return all(plain(x) for x in c)
    return False


def classify(x, mode: int) -> int:
    """What flat argument ``x`` is to a call made in ``mode``: the one place
    that decides. Eager and exported calls know tensors and modules (the rest
    are the call's own constants); traced calls also pass numpy arrays as
    tensors; compiled calls (traced by Dynamo) also carry ints and floats,
    which would otherwise recompile per value, and tell plain constants from
    other objects and iterators."""
    # (Tensors first: type() of a tensor compared with a class would add a
    # Dynamo guard run in Python, on torch.Tensor's identity.)
    if isinstance(x, _Tensor):
        return TENSOR_ARG
    if isinstance(x, nn.Module):
        return MODULE_ARG
    if mode == EAGER or mode == EXPORTED:
        return CONSTANT_ARG
    if mode == TRACED:
        return NDARRAY_ARG if is_ndarray(x) else CONSTANT_ARG
    t = type(x)
    if t is int:  # not bool or IntEnum: those stay constants
        return INT_ARG
    if t is float:  # Dynamo makes changing floats symbolic
        return FLOAT_ARG
    if is_ndarray(x):  # Dynamo holds arrays as tensors
        return NDARRAY_ARG
    if plain(x):
        return CONSTANT_ARG
    if isinstance(x, ITERATORS):
        return ITERATOR_ARG
    return OBJECT_ARG
