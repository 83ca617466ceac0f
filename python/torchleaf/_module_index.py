"""Finding a compiled call's module argument when its graph runs.

A compiled graph serves every module of one structure, so it cannot name
its module: a handle baked in as a constant, or read from the module (a
fresh module has none until torchleaf sees it), would make Dynamo guard the
graph on the module, and compile once per module. What the graph does get
is the module's tensors, lifted as inputs like any parameter. So the module
is found by them: by the address of its first tensor's data, which the
call's tensors (aliases of the module's own) share.

The index below maps that address to the modules torchleaf knows. A module
it does not know yet (built or loaded after the last compile, never called
eagerly) is looked for among the live instances of its class, once per
batch of new modules. Where the call's tensors are no module's own
(torch.func.functional_call under compile) any module of the structure
serves, provided all live ones agree in every attribute other than their
tensors (a search on every such call, with a warning the first time);
otherwise the call fails with an error that says what to do.
"""

from __future__ import annotations

import functools
import gc
import threading
import warnings
import weakref
from typing import Optional

import torch

from ._errors import LeafFunctionError
from ._modules import HANDLE_ATTR, ModuleStructure, ModuleView

# The tensor types whose data_ptr() is their data's address: a compiled
# call's tensors are plain tensors, or the module's own Parameters (passed
# through as they are); subclasses (fake, functional) may have none.
_PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_LOCK = threading.RLock()  # (weakref callbacks may run while it is held)

# The classes of module arguments that compiled calls traced, by name:
# ModuleStructure names its class, and the search for new modules needs it.
_CLASSES: dict[tuple[str, str], weakref.WeakSet] = {}
# Every module torchleaf knows, by class, by id (modules are not keys: one
# may define __eq__ without __hash__).
_KNOWN: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()


class _Entry:
    """A known module and its latest walk (see _modules.ModuleView)."""

    __slots__ = ("ref", "view", "key", "id", "cls", "__weakref__")

    def __init__(self, module, view):
        self.ref = weakref.ref(module, functools.partial(_forget, weakref.ref(self)))
        self.view = view
        self.key = data_key(view.tensors)
        self.id, self.cls = id(module), type(module)


def _forget(entry_ref, _):
    # (The entry weakly: a cycle through the callback would keep the
    # module's tensors, which its view holds, until a later collection.)
    entry: Optional[_Entry] = entry_ref()
    if entry is None:
        return
    entry_id = entry.id
    with _LOCK:
        _unfile(entry)
        if _ENTRIES.get(entry_id) is entry:
            del _ENTRIES[entry_id]
        known = _KNOWN.get(entry.cls)
        if known is not None and known.get(entry_id) is entry:
            del known[entry_id]


# data_key -> entries of modules whose first tensor's data is there. Read by
# _C.call_found_module too (an _Entry's `ref` and `view`, by name).
BY_DATA_ADDRESS: dict[int, list[_Entry]] = {}
_ENTRIES: dict[int, _Entry] = {}  # id(module) -> its entry


def _unfile(entry):
    entries = BY_DATA_ADDRESS.get(entry.key)
    if entries is not None and entry in entries:
        entries.remove(entry)
        if not entries:
            del BY_DATA_ADDRESS[entry.key]


def data_key(tensors) -> Optional[int]:
    """The address of the first tensor's data (None when no tensor has data:
    all empty, on the meta device, or fake tensors while tracing)."""
    for t in tensors:
        try:
            address = t.data_ptr()
        except RuntimeError:  # no storage: fake and functional tensors, DTensor
            return None
        if address:
            return address
    return None


def note_class(cls) -> None:
    """Called at trace time with the class of a module argument (and for
    every module indexed): what searches for new modules of a structure
    look for."""
    with _LOCK:
        _CLASSES.setdefault((cls.__module__, cls.__qualname__), weakref.WeakSet()).add(cls)


def remember(module, view=None) -> _Entry:
    """Index a module (an eager call's, a trace's, or one found by a search)."""
    entry = _ENTRIES.get(id(module))
    if entry is None or entry.ref() is not module:
        entry = _Entry(module, view if view is not None else ModuleView(module))
        cls = type(module)
        note_class(cls)
        with _LOCK:
            _ENTRIES[entry.id] = entry
            _KNOWN.setdefault(cls, {})[entry.id] = entry
            if entry.key is not None:
                BY_DATA_ADDRESS.setdefault(entry.key, []).append(entry)
    return entry


def _refresh(entry, module) -> None:
    """Walk the module again if it changed, and file it under its key now
    (module.to(), param.data = ... move a tensor's data)."""
    view = entry.view
    if not view.unchanged(module):
        view = entry.view = ModuleView(module)
    key = data_key(view.tensors)
    if key != entry.key:
        with _LOCK:
            _unfile(entry)
            entry.key = key
            if key is not None:
                BY_DATA_ADDRESS.setdefault(key, []).append(entry)


def find(leaf, structure: ModuleStructure, tensors) -> tuple:
    """(module, view) of the module of ``structure`` whose tensors the
    call's ``tensors`` are (its own, or aliases of them)."""
    # (The first tensor's address, as data_key gives it, inline: this runs
    # for each module argument of each compiled call.)
    key: Optional[int] = tensors[0].data_ptr() if tensors and type(tensors[0]) in _PLAIN_TENSOR_TYPES else 0
    if key:
        entries = BY_DATA_ADDRESS.get(key)
        if entries is not None and len(entries) == 1:
            entry = entries[0]
            module = entry.ref()
            if module is not None:
                view = entry.view
                # (The last tensor too: a module that ties only its first
                # tensor to this one's, say a shared embedding, is another.)
                if (
                    view.unchanged(module)
                    and (view.structure is structure or view.structure == structure)
                    and view.tensors[0].data_ptr() == key
                    and type(tensors[-1]) in _PLAIN_TENSOR_TYPES
                    and view.tensors[len(tensors) - 1].data_ptr() == tensors[-1].data_ptr()
                ):
                    return module, view
    else:
        key = data_key(tensors)
    return _find_slowly(leaf, structure, tensors, key)


def _search_for_new_modules(cls) -> None:
    """Index every live instance of ``cls`` (instances of a Python class
    refer to it): ~30 ms in a process with torch loaded, run when a call's
    module is not found."""
    for obj in gc.get_referrers(cls):
        if type(obj) is cls:
            remember(obj)


# Leaves whose compiled calls found no module owning their tensors (warned
# once each).
_WARNED_UNOWNED: weakref.WeakSet = weakref.WeakSet()


def _known(cls):
    """The live modules of class ``cls`` that torchleaf knows."""
    with _LOCK:
        entries = list(_KNOWN.get(cls, {}).values())
    return [m for m in (e.ref() for e in entries) if m is not None]


def _classes_of(structure):
    with _LOCK:
        return list(_CLASSES.get((structure.cls_module, structure.cls_qualname), ()))


def _owns(view, tensors) -> bool:
    """Whether the call's tensors are the viewed module's (the same data)."""
    try:
        return all(a.data_ptr() == b.data_ptr() for a, b in zip(tensors, view.tensors))
    except RuntimeError:  # no storage
        return False


def _candidates(structure, key, tensors):
    found = []
    for entry in list(BY_DATA_ADDRESS.get(key, ())) if key is not None else ():
        module = entry.ref()
        if module is not None:
            _refresh(entry, module)
            if entry.key == key and entry.view.structure == structure and _owns(entry.view, tensors):
                found.append((module, entry.view))
    return found


def _find_slowly(leaf, structure, tensors, key):
    found = _candidates(structure, key, tensors)
    if not found:
        # Known modules whose tensors moved since they were indexed.
        for cls in _classes_of(structure):
            for module in _known(cls):
                _refresh(remember(module), module)
        found = _candidates(structure, key, tensors)
    if not found:
        for cls in _classes_of(structure):
            _search_for_new_modules(cls)
        found = _candidates(structure, key, tensors)
    if len(found) == 1:
        return found[0]
    if found:  # modules sharing every tensor (a shallow copy and its original)
        return _one_of(leaf, structure, found, "share the tensors of this call")
    # The call's tensors are no module's own (functional_call): any module
    # of the structure runs them, if all live ones (the search above found
    # them all) agree in their other attributes.
    same = []
    for cls in _classes_of(structure):
        for module in _known(cls):
            entry = remember(module)
            _refresh(entry, module)
            if entry.view.structure == structure:
                same.append((module, entry.view))
    if same:
        module, view = _one_of(leaf, structure, same, "have this call's structure, and its tensors are none of theirs")
        if leaf not in _WARNED_UNOWNED:
            _WARNED_UNOWNED.add(leaf)
            warnings.warn(
                f"torchleaf: leaf function '{leaf._name}' was compiled with a {structure.cls_qualname} "
                f"argument whose tensors are no live module's own (torch.func.functional_call under "
                f"torch.compile?). It runs on a {structure.cls_qualname} of the same structure and "
                f"settings, found by searching all live objects on every such call (~30 ms). Pass "
                f"the tensors as arguments of the leaf, or call functional_call outside the compiled "
                f"region, to avoid that.",
                stacklevel=2,
            )
        return module, view
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' was compiled with a {structure.cls_qualname} argument, "
        f"and torchleaf finds no live {structure.cls_qualname} to run it on: a compiled call finds its "
        f"module by the module's tensors. Call the leaf once outside the compiled region with the module "
        f"(which makes torchleaf know it), or pass the module's tensors as arguments instead."
    )


def _one_of(leaf, structure, found, why):
    first, view = found[0]
    for module, _ in found[1:]:
        differs = _first_difference(first, module)
        if differs is not None:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' was compiled with a {structure.cls_qualname} "
                f"argument, and {len(found)} live modules {why}, differing in {differs!r}: a compiled "
                f"call finds its module by the module's tensors, so it cannot tell which one was passed. "
                f"Give each module tensors of its own (copy.deepcopy instead of copy.copy), or call the "
                f"leaf outside the compiled region."
            )
    return first, view


_TENSOR_STATE = ("_parameters", "_buffers", "_modules", HANDLE_ATTR)
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _same_value(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in _SIMPLE:
        return a == b
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, dict):  # hooks, mostly: empty in both
        return not a and not b
    return False


def _first_difference(a, b) -> Optional[str]:
    """The name of an attribute, other than tensors and submodules, in which
    two modules of one structure differ (walked with their submodules)."""
    for (prefix, x), (_, y) in zip(a.named_modules(remove_duplicate=False), b.named_modules(remove_duplicate=False)):
        if x is y:
            continue
        dx, dy = x.__dict__, y.__dict__
        for name in dx.keys() | dy.keys():
            if name in _TENSOR_STATE:
                continue
            if name not in dx or name not in dy or not _same_value(dx[name], dy[name]):
                return f"{prefix}.{name}" if prefix else name
    return None


def of_structure(leaf, structure, tensors):
    """A live module that has ``structure`` now, preferring one whose tensors
    have the shapes of ``tensors``: what a fake runs on (fake tensors say
    nothing of which module they stand for). Modules of one structure may
    differ in their settings (every nn.Linear has the structure of every
    other): a module with the call's shapes is looked for among all live
    ones before any other is taken."""
    fallback = None
    for searched in (False, True):
        if searched:
            for cls in _classes_of(structure):
                _search_for_new_modules(cls)
        for cls in _classes_of(structure):
            for module in _known(cls):
                entry = remember(module)
                _refresh(entry, module)
                if entry.view.structure != structure:
                    continue
                if all(a.shape == b.shape for a, b in zip(entry.view.tensors, tensors)):
                    return module
                if fallback is None:
                    fallback = module
    if fallback is not None:
        return fallback
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' was traced with a {structure.cls_qualname} argument, "
        f"but no module of that structure (parameters and buffers {list(structure.names)}) is "
        f"alive to run its fake implementation on."
    )
