"""The ``@leaf_function`` decorator and :class:`LeafFunction`.

Each LeafFunction is one entry of the C++ core (``torchleaf::call(leaf,
plan, inputs)``), removed when the LeafFunction dies. A call goes one of
three ways, decided here:

* eager calls (:meth:`LeafFunction.__call__`) pass their own non-tensor
  arguments (constants, modules) along with the call, and receive the real
  function's output description back from it: nothing travels through
  shared state;
* calls traced by Dynamo go to :func:`._dynamo.compiled_call`, and calls
  traced by torch.export to :func:`._export.exported_call`;
* other traced calls (make_fx, fake tensors, a functorch transform) bake
  constants into the plan and pass each nn.Module argument as its tensors
  plus a handle tensor that names the module at run time.

How arguments become tensors and back is :mod:`._signature`; what the real
function runs under is :mod:`._runner`.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
import weakref

import torch
from torch import nn

from . import _C, _dynamo, _export, _functorch, _runner
from ._classify import EAGER, MODULE_ARG, NDARRAY_ARG, TENSOR_ARG, TRACED, classify
from ._errors import LeafFunctionError, function_name
from ._live_leaves import LEAVES
from ._module_index import remember as remember_module
from ._modules import ModuleView, _unbound_handle, handle_of, modules_lock, own_handle
from ._modules import module_view as _module_view
from ._outputs import SINGLE, check_traced_outputs, decode
from ._plans import (
    IN_NDARRAY,
    IN_TENSOR,
    MODULE_KEY,
    NDARRAY,
    TENSOR,
    EagerArguments,
    Plans,
    positional_spec,
    split_module_tensors,
)
from ._signature import Signature
from ._torch_private import dynamo_is_tracing, is_exporting, pytree

# Arguments that are pytree leaves, besides tensors and modules.
_SCALARS = frozenset((int, float, bool, str, type(None)))

# Pickles of modules that torchleaf saw name this function here (a handle
# unpickles to "no handle"); it lives in _modules.
__all__ = ["LeafFunction", "leaf_function", "_unbound_handle"]

_Tensor = torch.Tensor
_Parameter = nn.Parameter
# Dynamo guards each global that traced code reads on every call of a
# compiled frame: __call__ reads these two.
# is_dynamo_compiling, not is_compiling: torch 2.13's is_compiling reads a
# process-wide flag that is set while any thread compiles, and an eager call
# in another thread would take the traced path.
_is_compiling = torch.compiler.is_dynamo_compiling
_compiled_call = _dynamo.compiled_call


class LeafFunction:
    """A function that tracers treat as one opaque operator call.

    Created by :func:`leaf_function`; not constructed directly. Calling it
    runs the real function on real tensors (eagerly, or inside compiled
    programs) with autograd from the function's own recorded graph; tracers
    (``torch.compile``, ``make_fx``, ``torch.export``) run the fake
    implementation set by :meth:`register_fake` instead and record one
    operator call. It behaves like the function it wraps: it keeps its name
    and docstring, works as a method, and is copied and pickled by reference.

    Example:
        >>> @torchleaf.leaf_function
        ... def scale(x, k):
        ...     return x * k
        >>> @scale.register_fake
        ... def _(x, k):
        ...     return torch.empty_like(x)
        >>> scale(torch.ones(2), 3.0)
        tensor([3., 3.])
    """

    def __init__(
        self, fn, mutates_args=(), validate_outputs=None, check_escaped_gradients=None, name=None, static_argnames=()
    ):
        if isinstance(fn, type) or not callable(fn):
            what = f"the class {fn.__qualname__}" if isinstance(fn, type) else f"a {type(fn).__name__} ({fn!r:.60})"
            raise LeafFunctionError(
                f"torchleaf.leaf_function decorates a function or a method, not {what}. To make a "
                f"module's computation a leaf, decorate the function its forward calls and pass the "
                f"module to it."
            )
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._fake = None
        if name is not None and (not isinstance(name, str) or name.count("::") != 1):
            raise LeafFunctionError(
                f"torchleaf: leaf function '{function_name(fn)}' got name={name!r}; a leaf's name "
                f"is a qualified operator name \"namespace::name\", e.g. \"mylib::gate\"."
            )
        self._qualified_name = name
        self._named_op = None  # its OpOverloadPacket, for exported calls
        self._name = name or function_name(fn)
        self._signature = Signature(self._name, fn, mutates_args, static_argnames)
        self._mutates_args = self._signature.mutates_args  # (read by every eager call)
        # A default argument is not an argument of the call: one that is a
        # tensor requiring grad would reach the body as a closure does (the
        # escaped-gradient error). Leaves with tensor defaults get a __call__
        # that passes them explicitly (_LeafFunctionWithTensorDefaults);
        # others pay nothing.
        self._tensor_defaults = self._signature.tensor_defaults()
        if self._tensor_defaults and type(self) is LeafFunction:
            self.__class__ = _LeafFunctionWithTensorDefaults
        self._plans = Plans(self._signature)
        self._output_types = {}  # "module.qualname" -> a type among outputs (_outputs: typed containers)
        # The core holds only a weak reference: the leaf dies with its last user.
        self._id = _C.define_python_leaf(
            self._name, _runner.run_real, _runner.run_fake, weakref.ref(self), validate_outputs,
            check_escaped_gradients, _runner.input_name,
        )
        weakref.finalize(self, _C.release_python_leaf, self._id)
        if name is not None:
            _C.bind_named_operator(name, self._id, bool(self._mutates_args), _export.plan_for_call)
            from ._ops import register_named_python_leaf

            self._named_op = register_named_python_leaf(name, bool(self._mutates_args), _export.named_fake)
            _export.NAMED[name] = self
        self._vmap_rule = None  # set by register_vmap
        LEAVES[self._id] = self

    def register_vmap(self, rule):
        """Set the leaf's batching rule for ``torch.func.vmap``.

        Without a rule a leaf runs once per sample under vmap and its outputs
        are stacked. The rule is used where no gradient transform runs inside
        the vmap (``vmap(f)``, ``grad(vmap(f))``); ``vmap(grad(f))`` runs the
        per-sample loop, whose backward replays each sample's graph.

        Args:
            rule: ``rule(info, in_dims, *args, **kwargs) -> (outputs,
                out_dims)``, the convention of ``torch.library.register_vmap``:
                ``in_dims`` has one entry per positional argument (the batch
                dimension of each tensor, or None), ``info.batch_size`` is the
                batch size, and ``out_dims`` gives each output's batch
                dimension (or one for all).

        Returns:
            ``rule``, so that this can be used as a decorator.

        Example:
            >>> @scale.register_vmap                      # doctest: +SKIP
            ... def _(info, in_dims, x, k):
            ...     return scale(x, k), in_dims[0]
        """
        _functorch.set_vmap_rule(self, rule)
        return rule

    def register_fake(self, fake):
        """Set the fake implementation, which tracers run instead of the function.

        The fake runs on fake tensors (no data) while a graph is traced; it
        must return outputs with the real function's structure, shapes,
        dtypes and devices. Eager calls do not need one.

        Args:
            fake: A callable with the leaf's signature. Build outputs with
                ``torch.empty``/``new_empty``/``empty_like``; a data-dependent
                size may come from ``nonzero()`` or
                ``torch.library.get_ctx().new_dynamic_size()``.

        Returns:
            The leaf itself, as PyTorch's built-in ``leaf_function`` does: a
            fake decorated under the leaf's own name (``@f.register_fake``
            over ``def f``) keeps ``f`` the leaf.

        Example:
            >>> @scale.register_fake                     # doctest: +SKIP
            ... def _(x, k):
            ...     return torch.empty_like(x)
        """
        self._fake = fake
        return self

    def register_multi_grad_hook(self, hook):
        """Not supported: a clear error, where PyTorch's built-in leaf_function
        takes a hook run with the gradients of the call's inputs.

        Args:
            hook: The hook that would have been registered.

        Raises:
            LeafFunctionError: Always; the message says what to use instead
                (``torch.autograd.graph.register_multi_grad_hook`` on the
                inputs, outside a compiled region).
        """
        raise LeafFunctionError(
            f"torchleaf: leaf function '{self._name}' cannot take a multi-grad hook: "
            f"register_multi_grad_hook of PyTorch's built-in leaf_function is not supported. Call "
            f"torch.autograd.graph.register_multi_grad_hook(inputs, hook) on the inputs that "
            f"require grad where the leaf is called (outside a compiled region), or return the "
            f"values the hook needs as outputs."
        )

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if isinstance(obj, type) and dynamo_is_tracing():
            # A @classmethod leaf (classmethod binds its function to the
            # class) read while Dynamo traces, which runs this natively and
            # cannot wrap the bound leaf ("Unexpected type in sourceless
            # builder", which named no leaf). Without fullgraph this is a
            # graph break, and the call runs eagerly, which works.
            raise LeafFunctionError(
                f"torchleaf: leaf function '{self._name}' is a @classmethod, which torch.compile "
                f"cannot call (its argument cls is the class {obj.__qualname__}). Make it a "
                f"@staticmethod or a plain function that takes what it reads from the class as "
                f"arguments, or call it outside the compiled region."
            )
        return _BoundLeaf(self, obj)

    def __repr__(self):
        return f"<torchleaf.LeafFunction {self._name}>"

    # Like a function: copied and pickled by reference (a model holding a
    # leaf can be deep-copied, and saved when the leaf is a module global).
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        # By reference, as a function pickles: by the module-level name bound
        # to the leaf. The call form (gate = leaf_function(body)) leaves
        # `body` bound to the undecorated function, which pickle refused as
        # "not the same object": the leaf is found by the name bound to it.
        qualname = self.__qualname__  # type: ignore[attr-defined]  # set by functools.update_wrapper
        module = sys.modules.get(self.__module__)
        found = module
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is self:
            return qualname
        for name, value in list(vars(module).items()) if module is not None else ():
            if value is self:
                return (_module_level_leaf, (self.__module__, name))
        raise LeafFunctionError(
            f"torchleaf: leaf function '{self._name}' cannot be pickled: it is pickled by reference, "
            f"by a module-level name bound to it, and {self.__module__}.{qualname} is "
            f"{'not defined' if found is None else 'the undecorated function'}. Define the leaf at "
            f"module level with the decorator (@torchleaf.leaf_function) or bind it to a "
            f"module-level name (gate = torchleaf.leaf_function(body))."
        )

    # -- calls
    def __call__(self, *args, **kwargs):
        if _is_compiling():
            return _compiled_call(self, args, kwargs)
        if not kwargs and not self._mutates_args:
            # Fast path: tensors only, by position.
            for a in args:
                if type(a) is not _Tensor and type(a) is not _Parameter:
                    break
            else:
                plan = self._plans.positional.get(len(args))
                if plan is None:
                    spec = pytree.tree_structure((args, {}))
                    plan = self._plans.positional[len(args)] = self._plans.from_key(
                        spec, (TENSOR,) * len(args), EAGER
                    )
                # `()` for arguments: the runner returns this call's own
                # output description (with None it would check it against
                # the plan's, as for a call through the operator, whose
                # outputs carry tensors only), and a call that must go
                # through the operator (a dispatch mode, a functorch
                # transform) returns None and takes the general path.
                result = _C.call(self._id, plan.index, args, (), ())
                if result is not None:
                    outputs, desc = result
                    if desc is SINGLE:
                        return outputs[0]
                    return decode(desc, outputs)
        if not kwargs:
            # By position, each argument a pytree leaf (tensors, modules,
            # scalars: a layer's leaf(block, x)): the flat arguments are the
            # arguments, without pytree's walk (~15 us per call).
            has_module = False
            for a in args:
                if isinstance(a, nn.Module):
                    has_module = True
                elif not (isinstance(a, _Tensor) or type(a) in _SCALARS):
                    break
            else:
                flat, spec = list(args), positional_spec(len(args))
                if has_module:
                    with modules_lock():
                        return self._call_flat(flat, spec)
                return self._call_flat(flat, spec)
        flat, spec = pytree.tree_flatten((args, kwargs))
        for x in flat:
            if isinstance(x, nn.Module):
                with modules_lock():
                    return self._call_flat(flat, spec)
        return self._call_flat(flat, spec)

    def _call_flat(self, flat, spec):
        # The core decides (one place, C++: ops::is_plain_eager) whether the
        # call runs eagerly, with the call's own arguments, or is recorded (a
        # tracer, a dispatch mode, a functorch transform): then it returns
        # None, and the call is described for a graph, constants baked in.
        plan, inputs, mutated, views = self._plan_for(flat, spec, traced=False)
        result = _C.call(self._id, plan.index, inputs, mutated, EagerArguments(flat, views))
        if result is not None:
            outputs, desc = result
            return decode(desc, outputs)
        if is_exporting():
            return _export.exported_call(self, flat, spec)
        self._check_no_sharded_modules(flat)
        plan, inputs, mutated, _ = self._plan_for(flat, spec, traced=True)
        outputs, desc = _C.call(self._id, plan.index, inputs, mutated, None)  # type: ignore[misc]  # never None here
        if desc is None:  # through the operator: rebuilt from the traced description
            desc = plan.out
            if plan.out_checks and type(outputs[0]) is not _Tensor:  # a trace (make_fx), not real tensors
                check_traced_outputs(self, plan.out_checks, outputs)
        return decode(desc, outputs)

    def _plan_for(self, flat, spec, traced):
        """(plan, inputs, mutated, (module, view) pairs checked) for an eager
        or traced (not compiled) call's flat arguments."""
        mode = TRACED if traced else EAGER
        key: list = []
        module_tensors = []
        handles = []
        views = []
        for x in flat:
            kind = classify(x, mode)
            if kind == TENSOR_ARG:
                key.append(TENSOR)
            elif kind == MODULE_ARG:
                handle = own_handle(x)
                if handle is None:  # made on eager calls too: later traces need it
                    view = ModuleView(x)
                    handle = handle_of(x)
                    handle.view = view
                    remember_module(x, view)  # what compiled calls find it by
                else:
                    view = _module_view(x, handle)
                key.append((MODULE_KEY, view.structure))
                module_tensors.append(view.tensors)
                handles.append(handle.tensor)
                views.append((x, view))
            elif kind == NDARRAY_ARG:
                key.append(NDARRAY)
            elif traced:
                try:
                    hash(x)
                except TypeError:
                    raise LeafFunctionError(
                        f"torchleaf: leaf function '{self._name}' got an argument of type "
                        f"{type(x).__name__}, which is not hashable, in a traced call: a traced "
                        f"graph keeps non-tensor arguments as constants. Pass it as a tensor (e.g. "
                        f"torch.as_tensor(x)) or make it hashable."
                    ) from None
                key.append(x)
            else:
                key.append(None)  # eager: the call passes its own constants
        plan = self._plans.from_key(spec, tuple(key), mode)
        inputs = []
        mutable_buffers: list = []
        modules = iter(module_tensors)
        for slot in plan.slots:
            if slot.kind == IN_TENSOR:
                inputs.append(flat[slot.position])
            elif slot.kind == IN_NDARRAY:
                inputs.append(torch.from_numpy(flat[slot.position]))
            else:
                split_module_tensors(slot.width, next(modules), inputs, mutable_buffers)
        if traced:
            inputs.extend(handles)
        if plan.mutated:
            _dynamo.check_read_and_mutated(self, flat, plan.slots, plan.mutated, plan.index)
        return plan, inputs, [flat[pos] for pos in plan.mutated] + mutable_buffers, tuple(views)

    def _check_no_sharded_modules(self, flat):
        for x in flat:
            if isinstance(x, nn.Module):
                for name, t in itertools.chain(x.named_parameters(), x.named_buffers()):
                    if type(t).__name__ == "DTensor":
                        raise LeafFunctionError(
                            f"torchleaf: leaf function '{self._name}' got a {type(x).__name__} "
                            f"argument whose '{name}' is a sharded DTensor: FSDP gathers a module's "
                            f"parameters in its own forward, which runs inside the leaf, too late. "
                            f"Shard only a parent of the module (fully_shard(model)), or gather it "
                            f"before the call: fully_shard(module, reshard_after_forward=False) and "
                            f"module.unshard() before calling the leaf."
                        )


class _LeafFunctionWithTensorDefaults(LeafFunction):
    """A leaf with tensor default arguments: one that requires grad (under
    grad mode) is passed explicitly when the call omits it, so that its
    gradient flows back as the undecorated function's does."""

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            bound = None
            for name, default in self._tensor_defaults:
                if default.requires_grad and name not in kwargs:
                    if bound is None:
                        bound = self._signature.parameters.bind_partial(*args, **kwargs).arguments
                    if name not in bound:
                        kwargs = {**kwargs, name: default}
        return LeafFunction.__call__(self, *args, **kwargs)


def _module_level_leaf(module, name):
    """Unpickles a leaf bound to a module-level name of its own (LeafFunction.__reduce__)."""
    return getattr(importlib.import_module(module), name)


class _BoundLeaf:
    """A leaf used as a method, bound to its instance (a plain callable
    object: Dynamo traces its call, where it cannot call a bound
    types.MethodType of a LeafFunction)."""

    __slots__ = ("__self__", "__func__")

    def __init__(self, leaf, obj):
        self.__func__ = leaf
        self.__self__ = obj

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def register_fake(self, fake):
        """``obj.method.register_fake``: the leaf's own (LeafFunction.register_fake)."""
        return self.__func__.register_fake(fake)

    def register_multi_grad_hook(self, hook):
        """The leaf's own: a clear error (LeafFunction.register_multi_grad_hook)."""
        return self.__func__.register_multi_grad_hook(hook)

    def __repr__(self):
        return f"<bound leaf function {self.__func__._name} of {self.__self__!r}>"


def leaf_function(
    fn=None, *, mutates_args=(), validate_outputs=None, check_escaped_gradients=None, name=None, static_argnames=()
):
    """Make ``fn`` a leaf function.

    A leaf function is opaque to ``torch.compile``, ``make_fx``, AOTAutograd,
    Inductor and ``torch.export`` (one operator call in every graph, no graph
    break), runs for real on every call, and is differentiable without a
    hand-written backward. Use as ``@leaf_function`` or
    ``@leaf_function(mutates_args={"buf"})``, then give it a fake
    implementation with ``@fn.register_fake`` (needed to trace it, not for
    eager calls).

    Args:
        fn: The function (or method). May take tensors, modules, numbers,
            numpy arrays, objects and pytrees of them, and return tensors,
            ints and constants in tuples, lists, dicts and other pytrees.
        mutates_args: Names of parameters whose tensors the function mutates
            in place (they must not require grad), or expressions into them
            as PyTorch's built-in leaf_function takes: ``"buffers[0]"``,
            ``'state["key"]'``, ``"model.running_mean"`` (a path into a module
            declares its buffers).
        validate_outputs: Per-leaf override of
            ``torchleaf.config.validate_outputs`` (None: the global flag).
        check_escaped_gradients: Per-leaf override of
            ``torchleaf.config.check_escaped_gradients`` (None: the global flag).
        name: ``"namespace::name"``: the leaf is also the operator
            ``torch.ops.namespace.name``, and ``torch.export`` records its
            calls as that operator; a process that loads the exported program
            must import the module that defines it first.
        static_argnames: Names of parameters whose values a compiled call
            bakes into its graph, as JAX's jit does: the fake sees their
            values (a capacity factor that sizes an output), and a new value
            compiles again. Other ints and floats reach the real function at
            run time, and a fake sees a stand-in for a float.

    Returns:
        A :class:`LeafFunction` wrapping ``fn`` (or, called with keywords
        only, a decorator that makes one).

    Raises:
        LeafFunctionError: ``fn`` is not callable or is a class, ``name`` is
            not ``"namespace::name"`` or is taken by a live leaf, or a
            ``mutates_args`` or ``static_argnames`` entry names no parameter.

    Example:
        >>> @torchleaf.leaf_function
        ... def gate(h, head):
        ...     scores = head(h)
        ...     if scores.abs().max() > 10:      # data-dependent: fine
        ...         print("large scores")
        ...     return scores.softmax(-1)
        >>> @gate.register_fake
        ... def _(h, head):
        ...     return h.new_empty(h.shape[0], head.out_features)
    """

    def wrap(f):
        return LeafFunction(
            f,
            mutates_args=mutates_args,
            validate_outputs=validate_outputs,
            check_escaped_gradients=check_escaped_gradients,
            name=name,
            static_argnames=static_argnames,
        )

    return wrap if fn is None else wrap(fn)
