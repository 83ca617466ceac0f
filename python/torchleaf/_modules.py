"""Module arguments: handles that name a module in traced graphs, views that
remember where a module keeps its tensors, and binders that run a function
with a module's parameters and buffers replaced by the call's tensors.

A module argument costs what its parameters cost: each is an operator input,
and the real function runs with the call's tensors in their places.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
import weakref
from typing import Any, NamedTuple

import torch

from . import _C
from ._errors import LeafFunctionError
from ._torch_private import assume_constant_result, reparametrize_module

_Tensor = torch.Tensor


class ModuleStructure(NamedTuple):
    """What a plan keys on for a module argument: its class and the names of
    its tensors, never its identity (one graph serves every module of the
    same structure)."""

    cls_module: str
    cls_qualname: str
    names: tuple  # each distinct parameter and buffer once, parameters first
    aliases: tuple  # (name, index into names) for each further name of one
    n_params: int

    @property
    def n_buffers(self) -> int:
        return len(self.names) - self.n_params


# One ModuleStructure object per structure (strings only, no user objects):
# a plan's and a view's compare by identity, at once, on every call.
_STRUCTURES: dict = {}


def interned(structure: ModuleStructure) -> ModuleStructure:
    return _STRUCTURES.setdefault(structure, structure)


# A module that torchleaf has seen eagerly carries a ModuleHandle in its
# __dict__, which keeps the module's latest walk (its view). Graphs traced
# from one call (make_fx, a functorch transform) take the handle's tensor as
# an input and the real function looks the module up by its value when the
# graph runs; compiled graphs find their modules by their tensors instead
# (_module_index), except a shallow copy's. The table holds modules weakly.
HANDLE_ATTR = "_torchleaf_handle"
_MODULES: dict = {}  # handle value -> weakref to the module
_MODULES_LOCK = threading.Lock()
_handle_values = itertools.count(1)


class ModuleHandle:
    """The value that names one module in traced graphs."""

    def __new__(cls, module):
        if module is None:  # (also what pickles of older versions unpickle to)
            return _UNBOUND
        return super().__new__(cls)

    def __init__(self, module):
        self.value = value = next(_handle_values)
        self.tensor = torch.tensor(value, dtype=torch.int64)
        self.view = None  # the module's ModuleView, once an eager call or a graph ran with it
        # Its module, weakly: a shallow copy (copy.copy) shares the handle in
        # its __dict__, and compiled calls tell it by this (_dynamo.compiled_call).
        self.owner = weakref.ref(module)

        def forget(_, value=value):
            _MODULES.pop(value, None)

        with _MODULES_LOCK:
            _MODULES[value] = weakref.ref(module, forget)

    def __deepcopy__(self, memo):
        # copy.deepcopy(model): the copy gets a handle of its own.
        ref = _MODULES.get(self.value)
        owner = ref() if ref is not None else None
        copy = memo.get(id(owner)) if owner is not None else None
        if copy is None:
            return _UNBOUND
        return ModuleHandle(copy)

    def __reduce__(self):
        # Handle values are process-local: an unpickled module gets a new
        # handle when torchleaf next sees it.
        return (_unbound_handle, ())


class _UnboundHandle:
    """What a handle becomes in an unpickled module: it names no module. A
    type of its own, so that traced code tells it from a module's handle by
    a type guard, which all modules share (a guard on a handle's value would
    give each module a graph of its own)."""

    value = 0
    view = None

    def __reduce__(self):
        return (_unbound_handle, ())

    def __deepcopy__(self, memo):
        return self


_UNBOUND = _UnboundHandle()


def _unbound_handle():
    return _UNBOUND


def module_state(module) -> tuple[tuple, tuple, int, list]:
    """(names, aliases, n_params, tensors): each distinct parameter and
    buffer once, parameters first, in the order graphs pass them, and
    (name, index) for every further name of one of them (tied weights, a
    submodule used twice)."""
    names: list[str] = []
    aliases: list[tuple[str, int]] = []
    tensors: list[torch.Tensor] = []
    n_params: Any = None
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in named:
            for i, seen in enumerate(tensors):
                if seen is t:
                    aliases.append((name, i))
                    break
            else:
                names.append(name)
                tensors.append(t)
        if n_params is None:  # after the parameters (a module may have none)
            n_params = len(tensors)
    return tuple(names), tuple(aliases), n_params, tensors


def _module_state_by_id(module):
    """module_state in one pass (identity by id(); the tensors stay alive in
    the result). module_state itself stays as it is: Dynamo traces it."""
    names: list[str] = []
    aliases: list[tuple[str, int]] = []
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    n_params: Any = None
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in named:
            i = seen.get(id(t))
            if i is not None:
                aliases.append((name, i))
            else:
                seen[id(t)] = len(tensors)
                names.append(name)
                tensors.append(t)
        if n_params is None:  # after the parameters (a module may have none)
            n_params = len(tensors)
    return tuple(names), tuple(aliases), n_params, tensors


def module_structure(module):
    """(structure, tensors): what a plan keys on for a module argument."""
    names, aliases, n_params, tensors = _module_state_by_id(module)
    cls = type(module)
    return interned(ModuleStructure(cls.__module__, cls.__qualname__, names, aliases, n_params)), tensors



# ------------------------------------------------------------ module views
# A module argument costs what its parameters cost: each one is an operator
# input, and the real function runs with the call's tensors in their places.
# Walking the module (named_parameters, PyTorch's _reparametrize_module) for
# every call cost milliseconds for a few hundred parameters, so what a walk
# finds is kept in a ModuleView on the module's handle: the structure, the
# tensors, and where each name lives (its owner's _parameters or _buffers
# dict). A call checks that nothing changed -- every submodule, dict and
# tensor is still the one seen, by identity, at C speed -- and walks again
# only when something did.
_is = operator.is_
_DICT_ATTRS = ("_parameters", "_buffers", "_modules")
_same_entries, _swap_entries, _restore_entries, _tensor_versions = (
    _C.same_entries, _C.swap_entries, _C.restore_entries, _C.tensor_versions
)
_call_bound_module = _C.call_bound_module
_get_parameters = operator.attrgetter("_parameters")
_get_buffers = operator.attrgetter("_buffers")
_get_modules = operator.attrgetter("_modules")


class ModuleView:
    """One walk of a module: its structure and tensors (as module_structure
    gives them), where to put the call's tensors, and what to re-check. It
    holds the module's submodules, dicts and tensors, never the module
    itself (it lives on the module's handle)."""

    __slots__ = (
        "structure", "tensors", "slot_dicts", "slot_keys", "slot_index", "slot_names",
        "submodules", "parameters", "buffers", "children", "dicts", "contents",
        "check_dicts", "check_keys", "check_values", "after_call_check",
        "slots_in_order", "slot_tensors",
    )

    def __init__(self, module):
        submodules = []
        where = {}  # name -> (owner dict, key)
        holders = {}  # id(dict) -> (its module, the attribute that holds it)
        for prefix, sub in module.named_modules(remove_duplicate=False):
            if sub is not module:
                submodules.append(sub)
            dot = prefix + "." if prefix else ""
            for attr in ("_parameters", "_buffers"):
                d = getattr(sub, attr)
                holders[id(d)] = (sub, attr)
                for key, t in d.items():
                    if t is not None:
                        where[dot + key] = (d, key)
        self.submodules = submodules
        everything = [module, *submodules]
        self.parameters = list(map(_get_parameters, everything))
        self.buffers = list(map(_get_buffers, everything))
        self.children = list(map(_get_modules, everything))
        self.dicts = self.parameters + self.buffers + self.children
        # What unchanged() compares, as _C.same_entries takes it: the dicts
        # of the module (None: read from the module's __dict__, which the
        # view must not hold) and of each submodule by key, then each of
        # those dicts whole, its items in order (one pass, no lookups).
        self.check_dicts = [None] * 3 + [sub.__dict__ for sub in submodules for _ in _DICT_ATTRS]
        self.check_keys = [*_DICT_ATTRS] * len(everything)
        self.check_values = [d for dicts in zip(self.parameters, self.buffers, self.children) for d in dicts]
        self.contents = [[x for item in d.items() for x in item] for d in self.dicts]
        # The structure as every other path computes it (named_parameters may
        # be overridden); slots only when the walk found every name there.
        self.structure, self.tensors = module_structure(module)
        names, aliases = self.structure.names, self.structure.aliases
        dicts, keys, index, slot_names, owners = [], [], [], [], set()
        for name, i in itertools.chain(((name, i) for i, name in enumerate(names)), aliases):
            found = where.get(name)
            if found is None:
                self.slot_dicts = None  # not a plain module: bound by name
                return
            d, key = found
            # A name of an attribute that another name already sets (one
            # submodule used twice) is set once.
            if (id(d), key) not in owners:
                owners.add((id(d), key))
                dicts.append(d)
                keys.append(key)
                index.append(i)
                slot_names.append(name)
        self.slot_dicts, self.slot_keys, self.slot_index, self.slot_names = dicts, keys, index, slot_names
        # What the C call checks after the function ran (same_entries'
        # arguments): only what decides where the structure's names lead --
        # the _modules dicts that hold children (a module without children
        # leads no name on) and the dicts that hold the slots, each still its
        # module's and holding what it held. What a function adds elsewhere
        # (a buffer on a module without slots, a child of a Linear) changes
        # no name's tensor, and the next call's full check sees it. (A third
        # of the full check's work for a stack of Linears, on every call.)
        contents_of = {id(d): items for d, items in zip(self.dicts, self.contents)}
        path = [
            (sub, "_modules", children)
            for sub, children in zip(everything, self.children)
            if contents_of[id(children)]
        ]
        held = set()
        for d in dicts:
            if id(d) not in held:
                held.add(id(d))
                path.append((*holders[id(d)], d))
        self.after_call_check = (
            [None if sub is module else sub.__dict__ for sub, _, _ in path],
            [attr for _, attr, _ in path],
            [d for _, _, d in path],
            [d for _, _, d in path],
            [contents_of[id(d)] for _, _, d in path],
        )
        # (The usual case: the call's tensors go to the slots as they come.)
        self.slots_in_order = index == list(range(len(index)))
        # What the slots hold.
        self.slot_tensors = self.tensors if self.slots_in_order else [self.tensors[i] for i in index]

    def restore_structure(self, module):
        """Puts back the submodules and dicts the walk saw where a call's
        function assigned others (the error path of a call that replaced
        a tensor of its module). Entries added elsewhere stay."""
        for d, key, value in zip(self.check_dicts, self.check_keys, self.check_values):
            owner = module.__dict__ if d is None else d
            if owner.get(key) is not value:
                owner[key] = value
        n = len(self.children)
        for d, items in zip(self.children, self.contents[len(self.contents) - n:]):
            pairs = list(zip(items[::2], items[1::2]))
            if len(d) != len(pairs) or any(d.get(key) is not value for key, value in pairs):
                d.clear()
                d.update(pairs)

    def unchanged(self, module, restored=None):
        """Whether `module` still has exactly what the walk saw: the same
        submodules, dicts and tensors, and nothing added. With `restored`
        ({(id(dict), key): tensor}), those entries must hold those tensors
        instead: what a call put back where an enclosing call of the same
        leaf had set its own (a module and one of its submodules passed
        together)."""
        if restored is None:  # (every call, twice: in C)
            return _same_entries(
                module.__dict__, self.check_dicts, self.check_keys, self.check_values, self.dicts, self.contents
            )
        everything = (module, *self.submodules)
        if not (
            all(map(_is, map(_get_parameters, everything), self.parameters))
            and all(map(_is, map(_get_buffers, everything), self.buffers))
            and all(map(_is, map(_get_modules, everything), self.children))
            and all(len(d) * 2 == len(items) for d, items in zip(self.dicts, self.contents))
        ):
            return False
        return all(
            d.get(key) is restored.get((id(d), key), value)
            for d, items in zip(self.dicts, self.contents)
            for key, value in zip(items[::2], items[1::2])
        )


def own_handle(module):
    """The module's handle if it names this module (not the original of a
    shallow copy), else None."""
    handle = module.__dict__.get(HANDLE_ATTR)
    if handle is not None:
        ref = _MODULES.get(handle.value)
        if ref is not None and ref() is module:
            return handle
    return None


def module_view(module, handle=None):
    """The module's view, walked again when the module changed."""
    if handle is None:
        handle = own_handle(module)
    view = handle.view if handle is not None else None
    if view is None or not view.unchanged(module):
        view = ModuleView(module)
        if handle is not None:
            handle.view = view
    return view


# Handles made while Dynamo traced a module that had none (sight_module),
# not yet set on the module: Dynamo may restart the trace (after a graph
# break later in the frame, e.g. loss.backward() in a compiled training
# step), and the restarted trace must see the module as the first did. Set on
# the module when it first runs (or is seen eagerly).
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> ModuleHandle


def handle_of(module):
    """The module's handle, made on first sight (or after a copy or unpickling
    left it with one that names another module)."""
    handle = own_handle(module)
    if handle is not None:
        return handle
    handle = _PENDING.pop(module, None) or ModuleHandle(module)
    module.__dict__[HANDLE_ATTR] = handle
    return handle


def module_by_handle(leaf, handle, structure):
    """The module a real call's handle tensor names."""
    ref = _MODULES.get(int(handle))
    module = ref() if ref is not None else None
    if _PENDING and module is not None and HANDLE_ATTR not in module.__dict__:
        # (A shallow copy keeps the original's: traced code tells it by that.)
        pending = _PENDING.pop(module, None)
        if pending is not None:
            module.__dict__[HANDLE_ATTR] = pending
    if module is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' was called from a graph with a "
            f"{structure.cls_qualname} argument that torchleaf cannot find: the module passed is a shallow "
            f"copy (copy.copy) of one that was deleted, and a shallow copy shares the original's "
            f"torchleaf handle. Use copy.deepcopy, or call the leaf with the copy once outside "
            f"the compiled region."
        )
    return module


@assume_constant_result
def sight_module(module):
    """Called by Dynamo at trace time for a module that a compiled call names
    by a handle but that has none of its own (a shallow copy of a module
    torchleaf knows, or a module without tensors to find it by): makes one
    (the same one again in a restarted trace; see _PENDING) and returns its
    value. Dynamo guards this trace on the module's identity."""
    handle = _PENDING.get(module)
    if handle is None:
        handle = _PENDING[module] = ModuleHandle(module)
    return handle.value


def _owner(module, name):
    prefix, _, attr = name.rpartition(".")
    return (id(module.get_submodule(prefix)), attr)


def _add_aliases(module, mapping, names, aliases, own):
    """Map the further names of tied tensors that are attributes of their own
    (tied weights of two modules). A name of an attribute that another name
    already sets (one submodule used twice) stays out: setting it twice
    would make PyTorch's _reparametrize_module restore the wrong tensor, and
    tie_weights=True does not restore the originals either."""
    owners = {_owner(module, name) for name in names}
    for name, i in aliases:
        owner = _owner(module, name)
        if owner not in owners:
            owners.add(owner)
            mapping[name] = own[i]


# Held by a call with module arguments from reading the modules' tensors
# until its function has run and the tensors are back (call_with_modules).
_MODULE_CALLS_LOCK = threading.RLock()


def modules_lock():
    """The lock a call with module arguments holds (reentrant: a leaf may call
    a leaf). A function, not an import: a forked child replaces it."""
    return _MODULE_CALLS_LOCK


def _new_module_calls_lock():
    # A child forked while another thread held the lock (a fork DataLoader
    # worker, multiprocessing) would wait forever for a thread it lacks.
    global _MODULE_CALLS_LOCK
    _MODULE_CALLS_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_module_calls_lock)


class _Binder:
    """Runs the function with one module's parameters and buffers replaced by
    the call's tensors: written straight into the dicts that hold them (the
    module's view says where), restored afterwards. A module whose view
    cannot say (named_parameters overridden, or a structure other than the
    plan's) goes through PyTorch's _reparametrize_module by name."""

    __slots__ = ("module", "structure", "own", "view", "new", "old", "versions", "replaced", "ctx", "mapping")

    def __init__(self, module, structure, own, buffers_mutable, view=None):
        self.module, self.structure, self.own = module, structure, own
        if view is None:
            view = module_view(module)
        if view.slot_dicts is None or (view.structure is not structure and view.structure != structure):
            view = None
        self.view = view
        self.replaced = None
        self.ctx = None
        # In-place changes to a module's tensors are the C++ core's undeclared
        # mutation error too, but only Python knows their names.
        self.versions = None if buffers_mutable else _tensor_versions(own)

    def enter(self):
        view = self.view
        if view is None:
            mapping = dict(zip(self.structure.names, self.own))
            if self.structure.aliases:
                _add_aliases(self.module, mapping, self.structure.names, self.structure.aliases, self.own)
            self.mapping = mapping
            # Not strict: a name of an attribute that another name of the
            # mapping already sets is left out (see _add_aliases).
            self.ctx = reparametrize_module(self.module, mapping, tie_weights=False, strict=False)
            self.ctx.__enter__()
            return
        own = self.own
        self.new = own if view.slots_in_order else [own[i] for i in view.slot_index]
        # A slot that already holds its call's tensor is left alone: a call
        # that records gradients gives the function each parameter as it is.
        # (The view was checked moments ago -- by an eager call, or by the
        # compiled call's module lookup -- so the slots hold the view's
        # tensors; the rest of a call's tensors are aliases, swapped in.)
        self.old = _swap_entries(view.slot_dicts, view.slot_keys, self.new, view.slot_tensors)

    def exit(self):
        if self.ctx is not None:
            try:
                current = dict(self.module.named_parameters(remove_duplicate=False))
                current.update(self.module.named_buffers(remove_duplicate=False))
                for name, tensor in self.mapping.items():
                    if current.get(name) is not tensor:
                        self.replaced = name
                        break
            finally:
                self.ctx.__exit__(None, None, None)
            return
        view = self.view
        self.after_restore(_restore_entries(view.slot_dicts, view.slot_keys, self.old, self.new))

    def after_restore(self, replaced):
        """What exit does after putting the module's own tensors back into
        the slots: note what the function replaced (``replaced``, the first
        slot that did not hold its call's tensor, or -1), and give every slot
        its module's tensor back if anything was."""
        view = self.view
        dicts, keys = view.slot_dicts, view.slot_keys
        if replaced >= 0:
            self.replaced = view.slot_names[replaced]
        elif not view.unchanged(self.module) and not view.unchanged(
            self.module, {(id(d), key): t for d, key, t in zip(dicts, keys, self.old)}
        ):
            # Something else changed during the call (a submodule assigned):
            # compare by name, as the function saw the module.
            current = dict(self.module.named_parameters(remove_duplicate=False))
            current.update(self.module.named_buffers(remove_duplicate=False))
            for name, i in itertools.chain(((n, i) for i, n in enumerate(self.structure.names)), self.structure.aliases):
                if current.get(name) is not view.tensors[i]:
                    self.replaced = name
                    break
        if self.replaced is not None:
            # The slots restore_entries skipped (never swapped) may hold what
            # the function put there, or nothing (del): every slot gets the
            # module's own back. (The error path: a plain loop.)
            for d, key, tensor in zip(dicts, keys, self.old):
                d[key] = tensor
            # A submodule the function assigned (or a dict it replaced)
            # goes too: the module is left as the walk saw it.
            view.restore_structure(self.module)

    def check(self, leaf):
        if self.versions is not None and _tensor_versions(self.own) != self.versions:
            for name, t, version in zip(self.structure.names, self.own, self.versions):
                if version is not None and t._version != version:
                    raise LeafFunctionError(
                        f"torchleaf: leaf function '{leaf._name}' changed '{name}' of its "
                        f"{type(self.module).__name__} argument in place without declaring it. Name that "
                        f"argument in mutates_args (its buffers may then change in place, e.g. "
                        f"BatchNorm's running statistics; its parameters never), or clone first."
                    )
        if self.replaced is not None:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' replaced '{self.replaced}' of its "
                f"{type(self.module).__name__} argument. The module's parameters and buffers "
                f"are the leaf's inputs and must not be reassigned inside it; return the "
                f"new value instead."
            )



def call_with_module(leaf, fn, args, module, structure, own, view):
    """call_with_modules for one module and arguments by position (the
    common call, without the general one's lists): in C (_C.call_bound_module)
    when the module's view, checked moments ago, places its tensors."""
    if view is not None:
        out = _call_bound_module(
            fn, args, module, view, own, structure, _MODULE_CALLS_LOCK, finish_found_call, leaf
        )  # fmt: skip
        if out is not NotImplemented:
            return out
    binder = _Binder(module, structure, own, False, view)
    with _MODULE_CALLS_LOCK:  # (see call_with_modules)
        binder.enter()
        try:
            out = fn(*args)
        finally:
            binder.exit()
    binder.check(leaf)
    return out


def finish_found_call(leaf, module, structure, own, view, old, new, replaced, versions, failed):
    """What _C.call_found_module and _C.call_bound_module call after the
    function ran when a name of the structure may no longer lead to its slot
    (ModuleView.after_call_check) or a tensor changed in place (``replaced``:
    restore_entries' answer; the slots hold the module's own tensors again):
    _Binder's exit, which restores what else the function changed, and,
    unless the function ``failed`` (raised), its check, which raises the
    error that names the argument."""
    binder = _Binder(module, structure, own, True, view)
    binder.new, binder.old, binder.versions = new, old, versions
    binder.after_restore(replaced)
    if not failed:
        binder.check(leaf)


def call_with_modules(leaf, fn, args, kwargs, bindings, checked_views=()):
    """``fn(*args, **kwargs)`` with each module of ``bindings`` ((module,
    structure, tensors, buffers_mutable, view or None), from Plan.rebuild)
    running on the call's tensors. A binding's view, or the view of
    ``checked_views`` ((module, view) pairs an eager call checked moments
    ago, only C++ running in between), is used without a check."""
    binders = []
    for module, structure, own, buffers_mutable, view in bindings:
        if view is None:
            view = next((v for m, v in checked_views if m is module), None)
        binders.append(_Binder(module, structure, own, buffers_mutable, view))
    # The call's tensors are the modules' while the function runs: no other
    # thread's call may read or swap them meanwhile (it would take this
    # call's aliases as the module's tensors, and restore them in place of
    # the originals). Reentrant: a leaf may call a leaf.
    with _MODULE_CALLS_LOCK:
        entered = []
        try:
            for binder in binders:
                binder.enter()
                entered.append(binder)
            out = fn(*args, **kwargs)
        finally:
            while entered:
                entered.pop().exit()
    for binder in binders:
        binder.check(leaf)
    return out
