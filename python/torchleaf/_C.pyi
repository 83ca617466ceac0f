# Type stubs for torchleaf._C, the pybind11 bindings over the C++ core.
# Private: use the torchleaf package. Kept in sync with csrc/python/module.cpp.

from typing import Any, Callable, Optional, Sequence

import torch

def _set_error_type(type: type[RuntimeError]) -> None:
    """Make torchleaf errors raise `type` (a RuntimeError subclass)."""

def _set_saved_hook_may_copy(check: Callable[[Callable[..., Any]], bool]) -> None:
    """Set check(pack_hook) -> bool: whether a saved-tensor pack hook may save a
    copy of a state handle (the core then keeps the state for the copy)."""

def define_python_leaf(
    name: str,
    runner: Callable[[Any, int, list[torch.Tensor], Any], tuple[list[torch.Tensor], Any]],
    fake_runner: Callable[[Any, int, list[torch.Tensor], Any, Any], list[torch.Tensor]],
    leaf_ref: Any,
    validate_outputs: Optional[bool] = None,
    check_escaped_gradients: Optional[bool] = None,
    input_namer: Optional[Callable[[Any, int, int], Optional[str]]] = None,
) -> int:
    """Register a Python leaf with the core and return its id. The core calls
    runner(leaf_ref, plan, tensors, arguments) -> (tensors, output
    description) and fake_runner(leaf_ref, plan, tensors, arguments, real
    description or None) -> tensors; for an error message,
    input_namer(leaf_ref, plan, index) -> str or None names the call's flat
    input `index` as its caller wrote it. `leaf_ref` should be a weak
    reference, so that the core keeps no user object alive."""

def bind_named_operator(
    name: str, leaf: int, mutating: bool, resolver: Callable[[int, str], int]
) -> None:
    """Make the operator `name` ('ns::op', defined on first use with schema
    (Tensor[] inputs, [Tensor(a!)[] mutated,] str call) -> Tensor[]) call the
    Python leaf `leaf`; resolver(leaf, call) -> plan turns a call description
    into a plan, once per distinct description. Fails when a live leaf or a
    C++ leaf has the name."""

def release_python_leaf(leaf: int) -> None:
    """Remove a Python leaf from the core (when its LeafFunction dies); graphs
    that still call it fail with a clear error."""

OPERATOR_SCHEMA_VERSION: int
"""Bumped whenever an operator schema or the meaning of its arguments changes."""

BUILT_TORCH_VERSION: str
"""The torch release the extension was compiled against ("2.13.0"; no local
part): torchleaf refuses to import under another."""

def leaf_count() -> int:
    """Number of leaves registered with the core."""

def call(
    leaf: int,
    plan: int,
    inputs: Sequence[torch.Tensor],
    mutated: Sequence[torch.Tensor],
    arguments: Any,
) -> Optional[tuple[list[torch.Tensor], Any]]:
    """Call a leaf. Plain eager calls run directly (no dispatcher round trip)
    with `arguments` (opaque, handed to the runners) and return (outputs, the
    real function's output description). Other calls go through
    torchleaf::call(leaf, plan, ...) and return (outputs, None) -- or None,
    without running anything, when `arguments` is not None: such calls must be
    described for a graph."""

def run_fake(
    leaf: int,
    plan: int,
    inputs: list[torch.Tensor],
    mutated: list[torch.Tensor],
    strides_relied_on: bool = False,
) -> list[torch.Tensor]:
    """Run a leaf's fake implementation for a call of `plan` (the fake kernel
    of every torchleaf operator). The outputs' metadata is recorded for the
    check of real calls, their strides only when `strides_relied_on`
    (Inductor's lowering)."""

def direct_operator_entry(name: str, replaced: Callable[..., Any]) -> Callable[..., Any]:
    """A callable for OpOverload._op of torchleaf::<name> ('call', 'forward'
    or 'backward'): calls the operator through a typed dispatcher call for the
    plain positional arguments compiled graphs pass, and `replaced` (PyTorch's
    own entry) for anything else."""

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

# The per-call dict work of module arguments (csrc/python/module_entries.cpp):
# _modules.ModuleView decides what to compare and where to write.

def same_entries(
    root: dict, dicts: list[Optional[dict]], keys: list[Any], values: list[Any], whole: list[dict], contents: list[list[Any]]
) -> bool:
    """Whether each dicts[i] (root where it is None) maps keys[i] to exactly
    values[i] (identity), and each whole[j] holds exactly the items
    contents[j] lists ([key0, value0, key1, ...], identity, in order)."""

def swap_entries(dicts: list[dict], keys: list[Any], values: list[Any], current: list[Any]) -> list[Any]:
    """Set dicts[i][keys[i]] = values[i] and return the entries replaced
    (KeyError, nothing changed, when one is missing); an entry whose value is
    current[i] (what the entries hold) is left alone."""

def restore_entries(dicts: list[dict], keys: list[Any], old: list[Any], expected: list[Any]) -> int:
    """Set every dicts[i][keys[i]] back to old[i]; return the index of the
    first entry that did not hold expected[i] before, or -1. Entries where
    old[i] is expected[i] (swap_entries left them alone) are skipped."""

def tensor_versions(tensors: list[torch.Tensor]) -> list[Optional[int]]:
    """Each tensor's version counter (None for an inference tensor)."""

# The common call with a module argument, in one C function
# (csrc/python/module_call.cpp).

def call_found_module(
    fn: Callable[..., Any],
    tensors: list[torch.Tensor],
    template: tuple,
    position: int,
    start: int,
    stop: int,
    tensor_places: tuple[tuple[int, int], ...],
    structure: Any,
    index: dict[int, list[Any]],
    lock: Any,
    finish: Callable[..., None],
    leaf: Any,
) -> Any:
    """``fn(*args)`` for a compiled call of a one-module plan, or
    NotImplemented, having done nothing, when the call needs a decision
    that Python makes. ``args`` is ``template`` with the module at
    ``position`` and ``tensors[k]`` at ``p`` for each ``(p, k)`` of
    ``tensor_places``; the module is the one ``index`` (_module_index's
    table) files under the address of ``tensors[start]``'s data, unchanged
    since its view was walked, of ``structure`` (the same object), whose first
    and last tensors share the data of ``tensors[start]`` and
    ``tensors[stop - 1]``. While ``fn`` runs, holding ``lock``, the module's
    slots hold ``tensors[start:stop]``. If the module is not exactly as it
    was after the call (an entry replaced, the module changed, a tensor
    changed in place), ``finish(leaf, module, structure, own, view, old, new,
    replaced, versions, failed)`` (_modules.finish_found_call) restores what
    else is needed and raises the error."""

def call_bound_module(
    fn: Callable[..., Any],
    args: list[Any],
    module: Any,
    view: Any,
    own: list[torch.Tensor],
    structure: Any,
    lock: Any,
    finish: Callable[..., None],
    leaf: Any,
) -> Any:
    """``fn(*args)`` with ``module``'s slots holding ``own`` (the call's
    tensors for it, in the order of ``view``'s), as call_found_module runs
    it, for a module and view the caller has (an eager call's, checked
    moments ago); NotImplemented, nothing done, where ``view`` cannot place
    the tensors (no slots, another structure)."""
