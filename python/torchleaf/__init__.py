"""torchleaf: leaf functions for PyTorch, with a C++ core.

A leaf function is opaque to torch.compile, make_fx, AOTAutograd, Inductor
and torch.export (one operator call in every graph), runs for real on every
call, and is differentiable without a hand-written backward: its own autograd
graph is captured per call and replayed in backward.
"""

import os as _os

import torch as _torch

from . import _C
from ._errors import LeafFunctionError

_C._set_error_type(LeafFunctionError)

from . import config  # noqa: E402
from ._leaf import LeafFunction, leaf_function  # noqa: E402
from ._ops import register_ops, sync_cpp_leaves  # noqa: E402

register_ops()


from ._caches import tag_operator_schema  # noqa: E402

tag_operator_schema()

#: Prefix for CMake's find_package(torchleaf): headers, libtorchleaf and the
#: CMake package shipped inside this Python package.
#: (Next to the compiled extension, which editable installs keep apart from
#: the Python sources.)
cmake_prefix_path = _os.path.join(_os.path.dirname(_C.__file__), "share", "cmake")


def live_states() -> int:
    """Count the captured autograd states alive now.

    A differentiable leaf call keeps the autograd graph its body recorded
    until backward no longer needs it (the graph is released, or the call's
    outputs die). Use it in tests to check that nothing leaks.

    Returns:
        The number of states alive in this process (C++ and Python leaves).

    Example:
        >>> y = leaf(x.requires_grad_())   # doctest: +SKIP
        >>> torchleaf.live_states()        # doctest: +SKIP
        1
        >>> del y; torchleaf.live_states() # doctest: +SKIP
        0
    """
    return _C.live_states()


def load_library(path: str) -> None:
    """Load a shared library that defines C++ leaf functions.

    Like ``torch.ops.load_library``, and then registers the fakes and ordered
    effects that make the library's leaves traceable from Python (their
    named operators ``torch.ops.<namespace>.<name>`` work under
    ``torch.compile`` and ``torch.export``).

    Args:
        path: The shared library (``.so``) built against libtorchleaf.

    Raises:
        OSError: The library cannot be loaded.
        LeafFunctionError: A leaf of the library has the name of a live leaf.

    Example:
        >>> torchleaf.load_library("build/libmyleaves.so")  # doctest: +SKIP
        >>> torch.ops.mylib.gate(x, w)                       # doctest: +SKIP
    """
    _torch.ops.load_library(path)
    sync_cpp_leaves()


__all__ = [
    "LeafFunction",
    "LeafFunctionError",
    "cmake_prefix_path",
    "config",
    "leaf_function",
    "live_states",
    "load_library",
    "sync_cpp_leaves",
]
