"""torchleaf: leaf functions for PyTorch, with a C++ core.

A leaf function is opaque to torch.compile, make_fx, AOTAutograd, Inductor
and torch.export (one operator call in every graph), runs for real on every
call, and is differentiable without a hand-written backward: its own autograd
graph is captured per call and replayed in backward.
"""

import os as _os
import re as _re

import torch as _torch

_REBUILD = (
    "Rebuild torchleaf against the installed torch: in torchleaf's source tree, "
    "`pip install --no-build-isolation .` (`-e .` for an editable install) or `make build`"
)


def _release(version: str) -> str:
    """'2.14.1' of '2.14.1+cu130' (or of a pre-release '2.15.0.dev20260101+cpu')."""
    match = _re.match(r"\d+\.\d+\.\d+", version)
    return match.group() if match else version.split("+", 1)[0]


def _check_torch_version(built: str, running: str) -> None:
    """Refuse to run the C++ extension under a torch other than the one it was
    compiled against (`built`: its TORCH_VERSION macro, e.g. "2.13.0";
    `running`: torch.__version__).

    The full release is compared, patch included: a C++ extension compiles
    against one release's headers (inline functions, class layouts, the
    dispatcher's entry points), which PyTorch keeps stable across no release,
    patch releases included, and a mismatch shows up as an undefined symbol at
    best, a crash or a wrong result at worst. The local part (+cpu, +cu130) is
    left out: the CPU and CUDA builds of one release compile the same C++ API
    (torchleaf calls no CUDA code), and the macro has none."""
    if _release(running) != built:
        raise ImportError(
            f"torchleaf's C++ extension was built against torch {built}, but torch "
            f"{running} is installed: a C++ extension runs only with the torch "
            f"release it was compiled against. {_REBUILD}, or install torch=={built}."
        )


try:
    from . import _C
except ImportError as error:
    # Built against another torch, the extension usually fails to load with
    # an undefined symbol before the check below can run.
    raise ImportError(
        f"torchleaf's C++ extension failed to load under torch {_torch.__version__} "
        f"({error}). If torch changed since torchleaf was built: {_REBUILD}."
    ) from error

_check_torch_version(_C.BUILT_TORCH_VERSION, _torch.__version__)

from ._errors import LeafFunctionError  # noqa: E402

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
