# Type stubs for torchleaf._C, the pybind11 bindings over the C++ core.
# Private: use the torchleaf package. Kept in sync with csrc/python/module.cpp.

from typing import Any, Callable, Optional, Sequence

import torch

def _set_error_type(type: type[RuntimeError]) -> None:
    """Make torchleaf errors raise `type` (a RuntimeError subclass)."""

def define_python_leaf(
    name: str,
    runner: Callable[[list[torch.Tensor], Any], tuple[list[torch.Tensor], Any]],
    fake_runner: Callable[[list[torch.Tensor], Any, Any], list[torch.Tensor]],
    call: Any,
    validate_outputs: Optional[bool] = None,
    check_escaped_gradients: Optional[bool] = None,
) -> int:
    """Register a Python leaf with the core and return its id. `call` is the
    fixed call description passed to the runners, or None to take it from the
    enclosing `call`."""

def call(
    leaf: int, inputs: Sequence[torch.Tensor], mutated: Sequence[torch.Tensor], call: Any
) -> tuple[list[torch.Tensor], Any]:
    """Call leaf `leaf` through torchleaf::call (all dispatch keys), with
    `call` as the Python call description for runners that take it from the
    caller. Returns (outputs, output description of the real call, or None
    when a tracer ran the fake instead). Releases the GIL around the C++
    work."""

def run_fake(leaf: int, inputs: list[torch.Tensor], mutated: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run a leaf's fake implementation (C++ leaves)."""

def named_leaves() -> list[tuple[int, str, list[int]]]:
    """[(id, 'ns::name', mutable positions)] for every C++ leaf with a named operator."""

def live_states() -> int:
    """Number of captured autograd states alive now."""

def get_validate_outputs() -> bool: ...
def set_validate_outputs(enabled: bool) -> None: ...
def get_check_escaped_gradients() -> bool: ...
def set_check_escaped_gradients(enabled: bool) -> None: ...
def scalar_type_code(tensor: torch.Tensor) -> int:
    """The c10::ScalarType code of a tensor's dtype."""

def device_type_name(code: int) -> str:
    """The name ('cpu', 'cuda', ...) of a c10::DeviceType code."""
