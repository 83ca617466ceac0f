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

#: What a fake sees for a float argument of a compiled call (fake tensors
#: hold no data).
FAKE_FLOAT = 1.0


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
