"""The functions the C++ core calls to run a Python leaf: its real function
(run_real), its fake (run_fake), and the name of an input for an error
message (input_name). They rebuild the user's arguments from the operator's
tensors with the call's plan, and describe what the function returned.
"""

import contextlib

import torch

from . import _C, _module_index, _modules
from . import _outputs as outputs
from ._caches import STABLE_IDS, fold_traced_fake
from ._errors import LeafFunctionError, add_note
from ._modules import call_with_module, call_with_modules, finish_found_call
from ._plans import IN_NDARRAY, IN_TENSOR, MODULE_KINDS
from ._torch_private import autocast_supported_devices, is_any_autocast_enabled, set_grad_enabled

_Tensor = torch.Tensor


def invoke(leaf, fn, plan, tensors, arguments, fake):
    """``fn`` (the real function, the fake, a vmap rule) called with the
    user's arguments, rebuilt from the operator's ``tensors`` and, for an
    eager call, its own ``arguments`` (an EagerArguments; None for a call
    through the operator)."""
    if plan.positional:
        return fn(*tensors[: len(plan.slots)]) if plan.ordered else fn(*tensors)
    if plan.one_module is not None and not fake:
        flat, module, own, view = plan.rebuild_one_module(leaf, tensors, arguments)
        return call_with_module(leaf, fn, flat, module, plan.one_module.structure, own, view)
    eager_flat = None if arguments is None else arguments.flat
    args, kwargs, bindings, flat = plan.rebuild(leaf, tensors, eager_flat, fake)
    if not bindings:
        out = fn(*args, **kwargs)
    else:
        checked = () if arguments is None else arguments.views
        out = call_with_modules(leaf, fn, args, kwargs, bindings, checked)
    if plan.containers and not fake:
        plan.check_containers_unchanged(leaf, args, kwargs, flat)
    return out


# ------------------------------------------------------------------ autocast
# A compiled program's runtime does not run its graph under autocast
# (AOTAutograd traced the autocast casts into the graph and disables it at
# run time), so a leaf's real function, which runs there, would not see the
# autocast it ran under eagerly. A compiled call records the autocast state it
# was traced under (part of its plan's key) and runs its fake and its real
# function under exactly that state.


def autocast_state():
    """None when autocast is off, else (((device type, dtype), ...) for each
    device type it is on for, whether its cache is on)."""
    if not is_any_autocast_enabled():
        return None
    enabled = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in autocast_supported_devices()
        if torch.is_autocast_enabled(device)
    )
    return enabled, torch.is_autocast_cache_enabled()


def invoke_compiled(leaf, fn, plan, tensors, arguments, fake):
    """invoke under the autocast state a compiled plan was traced under."""
    state = plan.autocast
    if state is None and not _is_any_autocast_enabled():
        return invoke(leaf, fn, plan, tensors, arguments, fake)
    enabled = dict(state[0]) if state is not None else {}
    with contextlib.ExitStack() as stack:
        for device in autocast_supported_devices():
            if device in enabled:
                stack.enter_context(torch.autocast(device, dtype=enabled[device], cache_enabled=state[1]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return invoke(leaf, fn, plan, tensors, arguments, fake)


def _check_autocast_dtypes(leaf, plan, flat):
    """Under autocast a fake written for full precision (x.new_empty(...))
    gives a dtype the real function does not: the compiled graph would read
    the real output as the fake's dtype."""
    for i, (t, dtype) in enumerate(zip(flat, plan.out_dtypes)):
        if isinstance(t, _Tensor) and t.dtype != dtype:
            enabled = ", ".join(f"{device}: {d}" for device, d in plan.autocast[0])
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' returned a {t.dtype} tensor at output {i} "
                f"under autocast ({enabled}), but its fake implementation gave {dtype} when the "
                f"call was compiled. The fake runs under the same autocast state as the real "
                f"function: compute its outputs with the same operations on its inputs (a @ b "
                f"gives the autocast dtype), or give them torch.get_autocast_dtype(device) when "
                f"torch.is_autocast_enabled(device)."
            )


_is_any_autocast_enabled = is_any_autocast_enabled
_is_grad_enabled = torch.is_grad_enabled
# torch.set_grad_enabled as a function builds a context-manager object in
# Python (~5k instructions per call and back); this is what it calls.
_set_grad_enabled = set_grad_enabled
_SINGLE = outputs.SINGLE
_call_found_module, _finish_found_call = _C.call_found_module, finish_found_call


def _live_leaf(leaf_ref):
    leaf = leaf_ref()
    if leaf is None:  # the core entry is removed with the leaf; a call in flight raced it
        raise LeafFunctionError("torchleaf: a leaf function was called after it was deleted.")
    return leaf


def _call_one_module(leaf, plan, tensors):
    """A compiled call of a one-module plan (a layer's leaf(block, x)): in C
    when its module is found at once, unchanged (csrc/python/module_call.cpp),
    else as Plan.rebuild_one_module and call_with_module do it."""
    layout = plan.one_module
    out = _call_found_module(
        leaf._fn, tensors, plan.template, layout.position, layout.start, layout.stop,
        layout.tensor_places, layout.structure, _module_index.BY_DATA_ADDRESS,
        _modules._MODULE_CALLS_LOCK, _finish_found_call, leaf,
    )  # fmt: skip
    if out is NotImplemented:
        flat, module, own, view = plan.rebuild_one_module(leaf, tensors, None)
        out = call_with_module(leaf, leaf._fn, flat, module, layout.structure, own, view)
    return out


def run_real(leaf_ref, plan_index, tensors, arguments):
    """Called by the core: run the user's function for one call. Returns the
    output tensors and the output description."""
    leaf = leaf_ref()
    if leaf is None:
        _live_leaf(leaf_ref)  # raises
    plan = leaf._plans.by_index[plan_index]  # (Plans.__getitem__ would be a frame)
    # Traced where grad mode was on, run where it is off: AOTAutograd runs a
    # graph none of whose inputs requires grad, and a training graph's
    # forward, with grad mode off. The function runs as in eager code:
    # autograd inside it works, and an output computed from a closure that
    # requires grad is reported (the core's escaped-gradient check) instead
    # of losing its gradient silently. (Capturing calls have it on already.)
    grad_off = plan.grad and not _is_grad_enabled()
    if grad_off:
        _set_grad_enabled(True)
    try:
        if plan.ordered:
            if plan.autocast is not None or _is_any_autocast_enabled():
                out = invoke_compiled(leaf, leaf._fn, plan, tensors, arguments, fake=False)
            elif plan.positional:
                # The common compiled calls, inline (what invoke_compiled and
                # invoke do for them): each Python frame on this path is paid,
                # and its code fetched cold, on every training step.
                out = leaf._fn(*tensors[: len(plan.slots)])
            elif plan.one_module is not None:
                out = _call_one_module(leaf, plan, tensors)
            else:
                out = invoke_compiled(leaf, leaf._fn, plan, tensors, arguments, fake=False)
        else:
            out = invoke(leaf, leaf._fn, plan, tensors, arguments, fake=False)
    except BaseException as e:
        add_note(e, f"raised inside the real function of leaf function '{leaf._name}'")
        raise
    finally:
        if grad_off:
            _set_grad_enabled(False)
    if isinstance(out, _Tensor) and plan.out is _SINGLE and plan.out_dtypes is None:
        # One tensor, as traced: flatten_output's and check_output's answer.
        return ([out, None] if plan.ordered else [out]), _SINGLE
    flat, desc = outputs.flatten_output(leaf, out, plan.out if plan.out_carries else None)
    if arguments is None:
        # Called through the operator (a graph, or a dispatch mode that runs
        # real kernels): the caller rebuilds outputs from the plan's
        # description, which the fake wrote when tracing.
        plan.check_output(leaf, desc)
    if plan.ordered:
        if plan.out_dtypes is not None:
            _check_autocast_dtypes(leaf, plan, flat)
        # The core appends a new order token in place of the None (cheaper
        # in C++ than torch.empty here, on every compiled call).
        flat = flat + [None]
    return flat, desc


def input_name(leaf_ref, plan_index, index):
    """Called by the core for an error message: call input ``index`` of plan
    ``plan_index`` as its caller wrote it ("argument 'x'", "argument
    'model.bn.running_mean'"); None for what the caller did not pass (a
    module's handle, the order token) or cannot be placed (the mutated
    tensors after them)."""
    leaf = leaf_ref()
    plan = None if leaf is None else leaf._plans.get(plan_index)
    if plan is None:
        return None
    found = plan.slot_of_input(index)
    if found is None:
        return None
    slot, within = found
    path = leaf._signature.argument_path(plan.spec, slot.position)
    if path is None or slot.kind not in (IN_TENSOR, IN_NDARRAY, *MODULE_KINDS):
        return None  # (an int's or a float's carrier: the body never sees it)
    if slot.kind in MODULE_KINDS:
        path += "." + slot.module.names[within]  # the tensor's name in the module
    return f"argument {path!r}"


def run_fake(leaf_ref, plan_index, tensors, arguments, real_desc):
    """Called by the core: run the fake for one call (tracers, or validation of
    the real call whose description is ``real_desc``)."""
    leaf = _live_leaf(leaf_ref)
    if leaf._fake is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' requires a fake implementation to be traced "
            f"(torch.compile, make_fx, torch.export, fake tensors) or validated. Register one with "
            f"@{leaf.__name__}.register_fake; it must return outputs with the same structure, "
            f"shapes and dtypes as the real function."
        )
    plan = leaf._plans[plan_index]
    try:
        if plan.ordered:
            out = invoke_compiled(leaf, leaf._fake, plan, tensors, arguments, fake=True)
        else:
            out = invoke(leaf, leaf._fake, plan, tensors, arguments, fake=True)
    except BaseException as e:
        add_note(e, f"raised inside the fake implementation of leaf function '{leaf._name}'")
        if torch.compiler.is_compiling() and _names_no_leaf_under_dynamo(e):
            # Dynamo reports an exception from a fake as "got KeyError(...)"
            # on the operator call, its context (and our note) suppressed.
            raise LeafFunctionError(
                f"torchleaf: the fake implementation of leaf function '{leaf._name}' raised "
                f"{type(e).__name__}: {e}"
            ) from e
        raise
    # Where an earlier trace of this call structure returned an int as a
    # carrier, an int is one here too: the operator's outputs, which every
    # graph of the plan indexes, must not change in number (a dynamic size
    # that the next trace specialized returns a plain int).
    flat, desc = outputs.flatten_output(leaf, out, plan.out if plan.out_carries else None)
    outputs.check_fake_constants(leaf, desc)
    if STABLE_IDS and arguments is None and real_desc is None:  # a trace
        fold_traced_fake(leaf._id, plan_index, flat)
    if plan.ordered:
        if plan.autocast is not None and arguments is None and real_desc is None:
            plan.out_dtypes = tuple(t.dtype if isinstance(t, _Tensor) else None for t in flat)
        flat = flat + [torch.empty(0, dtype=torch.int64)]  # a new order token
    if real_desc is not None:
        if outputs.structure_of(real_desc) != outputs.structure_of(desc):
            raise outputs.structure_mismatch(leaf, real_desc, desc)
    elif arguments is None:
        plan.record_output(leaf, desc, flat=flat)  # what a traced graph returns for this call structure
    return flat


def _names_no_leaf_under_dynamo(e):
    """Whether an exception from a fake would reach a torch.compile user
    without the leaf's name: the user's own (or Python's builtin) errors.
    Left alone: PyTorch's own (data-dependent shapes, guards, Dynamo's), and
    TypeError, which Dynamo turns into a graph break (get_fake_value): the
    compiler acts on them."""
    module = type(e).__module__ or ""
    return (
        isinstance(e, Exception)
        and not isinstance(e, (LeafFunctionError, TypeError))
        and module.split(".")[0] != "torch"
    )

