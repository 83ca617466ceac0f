"""How ints and floats travel through a graph as tensors: the one codec.

A compiled graph cannot hold a changing int or float as a constant (it would
recompile for each value), and an operator's schema takes tensors. So an int
travels as the *size* of a zero-stride int64 tensor, a carrier that holds no
memory: Dynamo and AOTAutograd see a symbolic size, and the value reaches the
function at run time. A size cannot be negative, so an int whose sign the
trace cannot know without a guard is zigzag-coded (2n for n >= 0, -2n - 1
for n < 0) in arithmetic only, so that a symbolic int passes unguarded. The
C++ core decodes the same code (csrc/ops: check_carried_int).

A float travels as a 0-dim float64 tensor.
"""

from __future__ import annotations

import torch

from ._errors import LeafFunctionError
from ._torch_private import guard_or_false

#: How an int is coded in its carrier's size: the size itself (known
#: non-negative), its negation (known negative), or zigzag (sign unknown).
SIZE, NEGATED, ZIGZAG = 0, 1, 2

#: Ints beyond this stay graph constants (seeds, hashes), as Dynamo keeps them.
MAX_CARRIED_INT = 2**62

class StandInFloat(float):
    """What a fake sees for a float argument of a compiled call: fake tensors
    hold no data, and the graph does not bake the float in (it would
    recompile for every value). Arithmetic on it gives stand-ins; reading its
    value -- an int or a size made from it (int(), round(), math.ceil), a
    comparison, a truth test -- raises an error that says how to bake the
    value in (static_argnames), instead of letting a size computed from the
    stand-in 1.0 fail later as a wrong fake."""

    leaf_name: str
    argument: str

    def __new__(cls, leaf_name, argument, value=1.0):
        self = super().__new__(cls, value)
        self.leaf_name, self.argument = leaf_name, argument
        return self

    def _read(self, *_):
        name = self.argument.strip("'")
        raise LeafFunctionError(
            f"torchleaf: the fake implementation of leaf function '{self.leaf_name}' read the value of "
            f"float argument {self.argument}, but a compiled call gives a fake a stand-in for a float "
            f"(its value reaches the real function only when the graph runs). If the fake needs the "
            f"value (an output's size made from it), mark the argument static: "
            f"leaf_function(..., static_argnames=({name!r},)) bakes its value into the graph, and "
            f"a new value compiles again."
        )

    __int__ = __trunc__ = __floor__ = __ceil__ = __round__ = __bool__ = _read
    __lt__ = __le__ = __gt__ = __ge__ = _read


def _stand_in_arithmetic(name):
    op = getattr(float, name)

    def method(self, *args):
        value = op(self, *args)
        return StandInFloat(self.leaf_name, self.argument, value) if type(value) is float else value

    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
              "__rpow__", "__neg__", "__pos__", "__abs__"):
    setattr(StandInFloat, _name, _stand_in_arithmetic(_name))


def zigzag(n):
    """2n for n >= 0, -2n - 1 for n < 0: a size, for an int of any sign
    (symbolic ints stay unguarded)."""
    return torch.sym_max(2 * n, -2 * n - 1)


def unzigzag(size):
    """The int whose zigzag code is ``size`` (arithmetic only: a fake gets a
    symbolic int unguarded)."""
    half, odd = size // 2, size % 2
    return half * (1 - 2 * odd) - odd


def encode(n, coding):
    """The carrier size of int ``n``."""
    if coding == ZIGZAG:
        return zigzag(n)
    return n if coding == SIZE else -n


def decode(size, coding):
    """The int a carrier of ``size`` carries."""
    if coding == ZIGZAG:
        return unzigzag(size)
    return size if coding == SIZE else -size


def input_carrier(n, coding):
    """The carrier of int argument ``n`` (traced by Dynamo): no memory."""
    return torch.empty(()).expand(encode(n, coding))


def float_carrier(x):
    """The 0-dim tensor of float argument ``x`` (traced by Dynamo). An
    addition, not torch.scalar_tensor: Dynamo keeps a float that feeds
    arithmetic symbolic, and specializes the other."""
    return torch.zeros((), dtype=torch.float64) + x


def coding_of_argument(x):
    """How a compiled call passes the int ``x`` (traced by Dynamo): SIZE or
    NEGATED when its sign is known, ZIGZAG when the trace cannot know it
    without a data-dependent guard (an unbacked int from ``.item()``), or
    None (the int stays a graph constant) beyond a size's range."""
    if guard_or_false(x > MAX_CARRIED_INT) or guard_or_false(x < -MAX_CARRIED_INT):
        return None
    if guard_or_false(x >= 0):
        return SIZE
    if guard_or_false(x < 0):
        return NEGATED
    return ZIGZAG


def output_carrier(leaf_name, n, coding):
    """The carrier of an int output ``n`` (a SymInt when a fake returned it):
    SIZE or ZIGZAG."""
    if coding == ZIGZAG:
        if isinstance(n, int) and not -MAX_CARRIED_INT <= n < MAX_CARRIED_INT:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf_name}' returned {n}, which a compiled call cannot "
                f"return where its fake returned a SymInt (|n| < 2**62)."
            )
    elif isinstance(n, int) and n < 0:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf_name}' returned {n} where its fake returned a size "
            f"(a non-negative int): make the fake return an int that may be negative."
        )
    # (empty_strided: an expand would be a view, whose base shares its
    # storage; the core copies an output whose storage is shared.)
    return torch.empty_strided((encode(n, coding),), (0,), dtype=torch.int64)
