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
from ._registration import _register_ops, sync_cpp_leaves  # noqa: E402

_register_ops()


def _tag_compile_caches():
    # PyTorch's on-disk compile caches key a graph that calls a C++ leaf by
    # the leaf's named operator, which does not change when torchleaf's own
    # operators do; the tag keeps artifacts of other torchleaf versions out.
    tag = f"torchleaf-ops-v{_C.OPERATOR_SCHEMA_VERSION}"
    config = _torch.compiler.config
    if tag not in config.cache_key_tag.split(";"):
        config.cache_key_tag = f"{config.cache_key_tag};{tag}" if config.cache_key_tag else tag


_tag_compile_caches()

#: Prefix for CMake's find_package(torchleaf): headers, libtorchleaf and the
#: CMake package shipped inside this Python package.
#: (Next to the compiled extension, which editable installs keep apart from
#: the Python sources.)
cmake_prefix_path = _os.path.join(_os.path.dirname(_C.__file__), "share", "cmake")


def live_states() -> int:
    """Number of captured autograd states alive now: one per differentiable
    leaf call whose autograd graph has not been released."""
    return _C.live_states()


def load_library(path: str) -> None:
    """Load a shared library that defines C++ leaf functions (like
    ``torch.ops.load_library``) and make them traceable from Python."""
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
