"""Call plans: how a call's arguments become the operator's tensors, and
how a :class:`Plan` rebuilds them.

A plan describes one call *structure*: the pytree spec of ``(args,
kwargs)``, what each flat argument is (a tensor, a module of some structure,
a carried int or float, a constant baked in; _classify.classify decides), the
declared mutations, and how the call is made (eagerly, traced, compiled).
Plans are keyed by a deterministic description of that structure, never by
object identity, and a graph names a plan by its index (a fingerprint, the
same in every process).
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from . import _carriers as carriers
from . import _module_index
from . import _outputs as outputs
from ._classify import COMPILED, EAGER
from ._errors import LeafFunctionError
from ._modules import ModuleStructure, interned, module_by_handle
from ._torch_private import pytree

if TYPE_CHECKING:
    from ._signature import Signature

_Tensor = torch.Tensor

# ------------------------------------------------------------- call keys
# A call's key has one entry per flat argument: a marker below, a module's
# (MODULE_KEY, ModuleStructure), or (traced and compiled plans) the
# constant itself; eager keys hold None for constants.
TENSOR = "\x00torchleaf:tensor"
MODULE_KEY = "\x00torchleaf:module"
# A compiled call's module that its graph names by a handle (a shallow copy
# of a module torchleaf knows): (SHARED_MODULE_KEY, ModuleStructure).
SHARED_MODULE_KEY = "\x00torchleaf:shared-module"
NDARRAY = "\x00torchleaf:ndarray"  # a numpy array a traced call passes as a tensor
FLOAT = "\x00torchleaf:float"  # a float a compiled program passes as a 0-dim tensor
# An int a compiled program passes as a carrier's size, by its coding.
INT_BY_CODING = {
    carriers.SIZE: "\x00torchleaf:int",
    carriers.NEGATED: "\x00torchleaf:-int",
    carriers.ZIGZAG: "\x00torchleaf:zigzag-int",
}
_CODING_OF_INT = {marker: coding for coding, marker in INT_BY_CODING.items()}

# ------------------------------------------------------------------ slots
# Kinds of operator inputs, in a plan's order.
IN_TENSOR, IN_MODULE, IN_INT, IN_NDARRAY, IN_FLOAT = range(5)
# A module named in mutates_args: its parameters are inputs, its buffers are
# declared mutable (BatchNorm's running statistics).
IN_MODULE_MUTABLE_BUFFERS = 5
MODULE_KINDS = (IN_MODULE, IN_MODULE_MUTABLE_BUFFERS)
# How a graph's real call finds a module argument (a module slot's coding):
# by a handle tensor that follows the slots' inputs (graphs traced from one
# call; compiled calls with a shallow copy, or a module whose tensors, all
# declared mutable, are no stable mark of it), or by its tensors (compiled
# calls; _module_index).
BY_HANDLE, BY_TENSORS = range(2)


class Slot(NamedTuple):
    """One argument that the operator receives as tensors."""

    kind: int  # IN_*
    position: int  # in the call's flat arguments
    module: Optional[ModuleStructure] = None  # module kinds
    # IN_INT: the carrier's coding (carriers.SIZE, ...); module kinds: BY_HANDLE or BY_TENSORS
    coding: Optional[int] = None

    @property
    def width(self) -> int:
        """How many of the operator's inputs it takes: a module's tensors
        (declared-mutable buffers excepted: they are mutated tensors), else one."""
        if self.module is None:
            return 1
        return len(self.module.names) if self.kind == IN_MODULE else self.module.n_params


def split_module_tensors(width: int, tensors, inputs: list, mutable_buffers: list) -> None:
    """A module slot's tensors: the inputs it takes (its width), and the
    rest, buffers declared mutable, as mutated tensors."""
    inputs.extend(tensors[:width])
    mutable_buffers.extend(tensors[width:])


class OneModuleLayout(NamedTuple):
    """Where a one-module plan's operator inputs go (Plan.one_module)."""

    position: int  # the module's flat position
    start: int  # its first operator input
    stop: int  # the input after its last
    structure: ModuleStructure
    tensor_places: tuple  # (flat position, operator input) of each tensor argument


def _one_module_layout(plan, mode):
    """For a plan whose real calls take one module and tensors by position,
    nothing declared mutable (a layer's leaf(block, x)): its layout, which
    Plan.rebuild_one_module and _runner take without rebuild's general walk.
    Else None."""
    if not plan.by_position or plan.mutated or plan.containers or mode not in (EAGER, COMPILED):
        return None
    module, tensor_places, k = None, [], 0
    for slot in plan.slots:
        if slot.kind == IN_TENSOR:
            tensor_places.append((slot.position, k))
        elif slot.kind != IN_MODULE or module is not None or (mode == COMPILED and slot.coding != BY_TENSORS):
            return None
        else:
            module = (slot.position, k, k + slot.width, slot.module)
        k += slot.width
    return None if module is None else OneModuleLayout(*module, tuple(tensor_places))


_FINGERPRINT_MASK = (1 << 62) - 1


def _fingerprint(full_key) -> int:
    """A plan's index: the same for the same call structure in every process.
    Graphs hold the index as a constant, and PyTorch's on-disk compile caches
    hand a graph compiled in one process to another whose graph reads alike:
    the index must then name the same call structure there (constants baked
    into the plan, which the graph does not show, included)."""
    try:
        text = repr(full_key)
    except Exception:  # a constant whose repr fails: a fingerprint of this process only
        text = f"{os.getpid()}:{id(full_key)}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _FINGERPRINT_MASK


_POSITIONAL_SPECS: dict = {}


def positional_spec(n: int):
    """The pytree spec of ``(args, {})`` for n leaf arguments by position."""
    spec = _POSITIONAL_SPECS.get(n)
    if spec is None:
        spec = _POSITIONAL_SPECS[n] = pytree.tree_structure((tuple(range(n)), {}))
    return spec


class EagerArguments(NamedTuple):
    """What an eager call hands its real function through the core (which
    holds it as an opaque object): the call's own flat arguments (constants
    and modules included), and the views of its modules that the call
    checked when it made its plan, which the function, moments later (only
    C++ runs in between), uses rather than checking again."""

    flat: list
    views: tuple  # ((module, _modules.ModuleView), ...)


class Plan:
    """How to rebuild one call structure's arguments from the operator's tensors.

    The operator receives ``inputs`` -- per ``slots`` entry a tensor, a
    module's parameters and buffers, or an int carrier; then, for traced
    plans, one handle tensor per module found BY_HANDLE; then, for compiled plans, the
    order token (not on a graph's first non-mutating call) -- and
    ``mutated``: tensor leaves of the parameters named in ``mutates_args``,
    then the buffers of modules named there, in that order.
    Compiled plans also return a new order token after the function's
    outputs.
    """

    __slots__ = (
        "index", "spec", "template", "slots", "mutated", "ordered", "positional", "out",
        "out_plain", "out_from_real", "out_carries", "out_checks", "out_varied", "autocast", "out_dtypes",
        "grad", "containers", "n_slot_inputs", "n_handles", "by_position", "one_module",
    )

    def __init__(self, index, spec, template, slots, mutated, mode, positional, autocast=None, grad=False):
        self.index: int = index
        self.spec = spec
        # The flat arguments with baked constants (traced plans) and None
        # where tensors, modules and carried ints go.
        self.template: tuple = template
        self.slots: tuple[Slot, ...] = slots
        self.mutated: tuple[int, ...] = mutated  # flat positions of declared-mutable tensors
        self.ordered: bool = mode == COMPILED
        self.positional: bool = positional  # tensors only, by position: call fn(*tensors)
        # Operator inputs the slots take, and the handles that follow them.
        self.n_slot_inputs = sum(slot.width for slot in slots)
        self.n_handles = sum(1 for slot in slots if slot.kind in MODULE_KINDS and slot.coding == BY_HANDLE)
        # (args index or kwargs key, first flat position, spec, leaves only)
        # of each argument that holds a mutable container, which the real
        # function gets rebuilt (check_containers_unchanged).
        self.containers = () if positional else _mutable_container_arguments(spec)
        # Leaf arguments by position only: rebuilt as tuple(flat), without pytree.
        self.by_position = spec == positional_spec(spec.num_leaves)
        self.one_module: Optional[OneModuleLayout] = _one_module_layout(self, mode)
        self.out = None  # the fake's output description, once traced
        self.out_plain = False  # whether `out` holds no constants
        self.out_from_real = False  # `out` came from a real call, no fake ran
        self.out_carries = False  # `out` has ints that travel as carriers
        self.out_checks: tuple = ()  # what the latest trace's code checks (outputs.output_checks)
        # (earlier, later) descriptions of two fake runs for this call
        # structure whose structures differ: compiled code may keep either.
        self.out_varied = None
        # Compiled plans: the autocast state the call was traced under
        # (_runner.autocast_state), entered around its fake and its real function.
        self.autocast = autocast
        # Compiled plans traced under autocast: the fake's output dtypes,
        # which the real outputs must have.
        self.out_dtypes = None
        # Compiled plans: whether grad mode was on where the call was traced
        # (Dynamo guards it), so that the real function runs with it on as
        # it would in eager code (_runner.run_real).
        self.grad: bool = grad

    def takes_token(self, n_inputs: int) -> bool:
        """Whether a call whose ``inputs`` hold ``n_inputs`` tensors ends them
        with an order token: compiled calls do, except a graph's first
        non-mutating one (_dynamo: first_ordered_call)."""
        return self.ordered and n_inputs > self.n_slot_inputs + self.n_handles

    def record_output(self, leaf, desc, from_real=False, flat=None):
        """Record the description of what a traced graph returns for this
        call structure (with `flat`, the fake's outputs, what traced code
        checks against the real ones: outputs.output_checks)."""
        if (
            self.out is not None
            and not self.out_from_real
            and outputs.structure_of(self.out, carried_as_int=True) != outputs.structure_of(desc, carried_as_int=True)
        ):
            # Graphs traced with the earlier structure would return it: their
            # calls fail from now on (check_output), and so does this trace.
            self.out_varied = (self.out, desc)
            raise outputs.fake_structure_varied(leaf, self.out, desc)
        self.out = desc
        self.out_plain = next(outputs.constants(desc), None) is None
        self.out_from_real = from_real
        self.out_carries = outputs.has_int_carriers(desc)
        self.out_checks = () if flat is None else outputs.output_checks(desc, flat)

    def check_output(self, leaf, desc):
        """Check a real call's output description against the traced one: a
        graph returns the traced structure and constants, whatever the real
        function returns. Without constants, equal descriptions are equal
        structures, which a tuple comparison tells at C speed on every call."""
        traced = self.out
        if self.out_varied is not None:
            raise outputs.fake_structure_varied(leaf, *self.out_varied)
        if traced is None:
            self.record_output(leaf, desc, from_real=True)  # no fake ran (a non-tracing dispatch mode)
        elif traced is not desc and not (self.out_plain and traced == desc):
            if outputs.structure_of(traced) != outputs.structure_of(desc):
                raise outputs.structure_mismatch(leaf, desc, traced)
            outputs.check_graph_constants(leaf, traced, desc, self.out_from_real)

    def rebuild(self, leaf, tensors, eager_flat, fake):
        """(args, kwargs, [(module, structure, tensors, buffers_mutable,
        view or None)], flat) for one call, from the operator's tensors and,
        for an eager call, its own flat arguments; `flat`, the leaves (args,
        kwargs) were built from."""
        flat = list(eager_flat) if eager_flat is not None else list(self.template)
        k = 0
        modules: list[tuple[int, Any, list, bool, bool]] = []
        for slot in self.slots:
            kind, pos = slot.kind, slot.position
            if kind == IN_TENSOR:
                flat[pos] = tensors[k]
            elif kind == IN_NDARRAY:
                # The real function gets its array back (sharing memory);
                # a fake, running on fake tensors, gets the tensor.
                t = tensors[k]
                flat[pos] = t if fake and (type(t) is not _Tensor or t.is_meta) else t.numpy()
            elif kind == IN_FLOAT:
                # Dynamo does not specialize floats: the value reaches the
                # function at run time. A fake gets a placeholder (fake
                # tensors hold no data).
                t = tensors[k]
                if fake and (type(t) is not _Tensor or t.is_meta):
                    flat[pos] = carriers.StandInFloat(leaf._name, leaf._signature.argument_at(self.spec, pos))
                else:
                    flat[pos] = t.item()
            elif kind == IN_INT:
                flat[pos] = carriers.decode(tensors[k].shape[0], slot.coding)
            else:  # a module
                n = slot.width
                own = list(tensors[k : k + n])
                modules.append((pos, slot.module, own, kind == IN_MODULE_MUTABLE_BUFFERS, slot.coding == BY_HANDLE))
                k += n
                continue
            k += 1
        views = {}
        if eager_flat is None:
            for pos, structure, own, _, by_handle in modules:
                if fake:
                    # Fake tensors say nothing of which module they stand for:
                    # any live module of the structure runs the fake.
                    flat[pos] = _module_index.of_structure(leaf, structure, own)
                elif by_handle:
                    flat[pos] = module_by_handle(leaf, tensors[k], structure)
                else:
                    flat[pos], views[pos] = _module_index.find(leaf, structure, own)
                if by_handle:
                    k += 1
        if self.ordered and k < len(tensors):
            k += 1  # the order token (a graph's first call has none, unless it mutates)
        for pos in self.mutated:
            flat[pos] = tensors[k]
            k += 1
        bindings: list[tuple] = []
        for pos, structure, own, buffers_mutable, _ in modules:
            if buffers_mutable:  # its buffers come last
                n = structure.n_buffers
                own.extend(tensors[k : k + n])
                k += n
            module = flat[pos]
            # The same module passed twice is bound once: its first slot's
            # tensors go unused (zero gradients, which add up right).
            bindings = [b for b in bindings if b[0] is not module]
            bindings.append((module, structure, own, buffers_mutable, views.get(pos)))
        if self.by_position:
            return tuple(flat), {}, bindings, flat
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return args, kwargs, bindings, flat

    def rebuild_one_module(self, leaf, tensors, arguments):
        """rebuild for a one_module plan's real call: (flat arguments,
        module, its tensors, its view or None)."""
        layout = self.one_module
        assert layout is not None  # (callers check)
        own = list(tensors[layout.start : layout.stop])
        if arguments is None:  # a compiled call: the module is found by its tensors
            flat = list(self.template)
            module, view = _module_index.find(leaf, layout.structure, own)
            flat[layout.position] = module
        else:  # an eager call passes its module, checked moments ago
            flat = list(arguments.flat)
            module = flat[layout.position]
            view = next((v for m, v in arguments.views if m is module), None)
        for p, k in layout.tensor_places:
            flat[p] = tensors[k]
        return flat, module, own, view

    def slot_of_input(self, index: int):
        """(slot, index within the slot) of operator input ``index``; None for
        what no slot takes (a module's handle, the order token, mutated
        tensors)."""
        n = 0
        for slot in self.slots:
            if index < n + slot.width:
                return slot, index - n
            n += slot.width
        return None

    def check_containers_unchanged(self, leaf, args, kwargs, flat):
        """After the real function ran on containers rebuilt for the call:
        an error if it changed one in place (``log.append(...)``,
        ``cfg["k"] = v``), which the caller's own container would never see."""
        for key, start, spec, leaves_only in self.containers:
            obj = args[key] if type(key) is int else kwargs[key]
            changed = _changed_container(obj, spec, flat, start, leaves_only)
            if changed is None:
                continue
            name = leaf._signature.parameter_name(key)
            what = f"argument {name!r}" if name is not None else f"positional argument {key}"
            what = f"its {what} (a {type(obj).__name__})" if changed is obj else (
                f"a {type(changed).__name__} inside its {what}"
            )
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' changed {what} in place. A leaf function "
                f"gets its own copy of each list, dict or other container it is passed (the tensors "
                f"inside become the call's own), so the caller's container would not see the change. "
                f"Return what the function computes and update the container outside the leaf, or "
                f"pass an object of a class of your own, which the function gets itself."
            )


def _changed_container(obj, spec, flat, start, leaves_only=None):
    """The container in `obj`, rebuilt for a call as `spec` describes with
    the leaves flat[start:], that the function changed in place; None if
    none. `leaves_only`: whether `spec`'s children are all leaves (computed
    when not given)."""
    t = spec.type
    if t is list or t is tuple:
        if type(obj) is not t or len(obj) != spec.num_children:
            return obj
        items: Any = obj
    elif t is dict:
        if type(obj) is not dict or list(obj) != spec.context:  # (a defaultdict read adds a key)
            return obj
        items = obj.values()
    else:  # another pytree node: compared through the pytree
        leaves, now = pytree.tree_flatten(obj)
        same = now == spec and all(map(operator.is_, leaves, flat[start : start + spec.num_leaves]))
        return None if same else obj
    children = spec.children()
    if leaves_only is None:
        leaves_only = all(child.is_leaf() for child in children)
    if leaves_only:
        return None if all(map(operator.is_, items, flat[start : start + len(children)])) else obj
    for item, child in zip(items, children):
        if child.is_leaf():
            if item is not flat[start]:
                return obj
        else:
            changed = _changed_container(item, child, flat, start)
            if changed is not None:
                return changed
        start += child.num_leaves
    return None


def _mutable_container_arguments(spec):
    """(args index or kwargs key, first flat position, spec, whether its
    children are all leaves) of the top-level call arguments in `spec`
    ((args, kwargs)) that hold a container other than a tuple."""
    args_spec, kwargs_spec = spec.children()
    names = list(range(args_spec.num_children)) + list(kwargs_spec.context)
    found, start = [], 0
    for name, sub in zip(names, [*args_spec.children(), *kwargs_spec.children()]):
        if _holds_mutable_container(sub):
            found.append((name, start, sub, all(child.is_leaf() for child in sub.children())))
        start += sub.num_leaves
    return tuple(found)


def _holds_mutable_container(spec):
    if spec.is_leaf():
        return False
    if not issubclass(spec.type, tuple):  # a list, a dict, a dataclass...
        return True
    return any(_holds_mutable_container(child) for child in spec.children())


class Plans:
    """A leaf's plans, by index (what graphs name) and by call key."""

    def __init__(self, signature: "Signature"):
        self.signature = signature
        self.by_index: dict[int, Plan] = {}
        self._by_key: dict[Any, Plan] = {}
        self._by_position: dict[Any, Plan] = {}  # (mode, key, autocast, grad) of by-position calls
        self.positional: dict[int, Plan] = {}  # arity -> eager plan of all-tensor positional calls
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> Plan:
        return self.by_index[index]

    def get(self, index: int) -> Optional[Plan]:
        return self.by_index.get(index)

    def from_key(self, spec, key: tuple, mode: int, autocast=None, grad: bool = False) -> Plan:
        """The plan for a call key (see "call keys" above). Compiled plans also
        key on the autocast state and the grad mode they were traced under."""
        # Calls by position key without their spec (hashing a TreeSpec walks
        # it in Python: ~4 us, on every eager call).
        by_position = spec is _POSITIONAL_SPECS.get(len(key))
        if by_position:
            plan = self._by_position.get((mode, key, autocast, grad))
            if plan is not None:
                return plan
        full_key = (mode, spec, key, autocast, grad)
        plan = self._by_key.get(full_key)
        if plan is not None:
            if by_position:
                self._by_position[(mode, key, autocast, grad)] = plan
            return plan
        with self._lock:
            plan = self._by_key.get(full_key)
            if plan is not None:
                return plan
            mutated_positions = self.signature.mutated_positions(len(key), spec)
            template, slots, mutated = [], [], []
            for pos, k in enumerate(key):
                if k is TENSOR:
                    if pos in mutated_positions:
                        mutated.append(pos)
                    else:
                        slots.append(Slot(IN_TENSOR, pos))
                elif type(k) is tuple and len(k) == 2 and (k[0] is MODULE_KEY or k[0] is SHARED_MODULE_KEY):
                    kind = IN_MODULE_MUTABLE_BUFFERS if pos in mutated_positions else IN_MODULE
                    structure = interned(ModuleStructure(*k[1]))
                    slot = Slot(kind, pos, structure, BY_HANDLE)
                    if mode == COMPILED and k[0] is MODULE_KEY and slot.width:
                        slot = slot._replace(coding=BY_TENSORS)
                    slots.append(slot)
                elif type(k) is str and k in _CODING_OF_INT:
                    slots.append(Slot(IN_INT, pos, coding=_CODING_OF_INT[k]))
                elif k is NDARRAY:
                    slots.append(Slot(IN_NDARRAY, pos))
                elif k is FLOAT:
                    slots.append(Slot(IN_FLOAT, pos))
                else:
                    template.append(k)
                    continue
                template.append(None)
            positional = (
                len(slots) == len(key) and all(slot.kind == IN_TENSOR for slot in slots)
                and spec == pytree.tree_structure((tuple(range(len(key))), {}))
            )
            index = _fingerprint(full_key)
            while index in self.by_index:  # two call structures that print alike
                index = (index + 1) & _FINGERPRINT_MASK
            plan = Plan(index, spec, tuple(template), tuple(slots), tuple(mutated), mode, positional, autocast, grad)
            self.by_index[index] = plan
            self._by_key[full_key] = plan
            return plan
