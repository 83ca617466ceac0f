"""torch.func support: vmap rules for torchleaf's operators.

Gradients (``torch.func.grad``, ``vjp``, ``jacrev``) need no rule of their
own: a leaf call under a grad transform is ``torchleaf::forward`` plus a
``LeafBackward`` node, as under any tracer. vmap needs a batching rule for
every torchleaf operator; they are registered here with
``torch.library.register_vmap`` and run only while a vmap is active (plain
calls never reach them).

The default rule is a per-sample loop: batched inputs are unbound along
their batch dimension, the leaf runs once per sample (unbatched inputs as
they are), and its outputs are stacked along dimension 0. Under a gradient
inside the vmap (``vmap(grad(f))``, per-sample gradients) the loop runs
``torchleaf::forward`` per sample and returns one *stacked* state handle
(``torchleaf::stack_handles``) batched like the outputs, so the batching rule
of ``torchleaf::backward`` replays each sample's own captured graph.

A Python leaf may replace the loop with its own rule
(``LeafFunction.register_vmap``, the convention of
``torch.library.register_vmap``); it is used where the leaf is called under
vmap without a gradient transform inside the vmap (``vmap(f)``,
``grad(vmap(f))``). Under ``vmap(grad(f))`` the per-sample loop runs, since
its backward must replay per-sample graphs.
"""


import torch

from . import _C
from . import _outputs as outputs
from ._errors import LeafFunctionError, add_note
from ._live_leaves import LEAVES  # Python leaves by id (their names, plans and vmap rules)
from ._plans import IN_TENSOR, MODULE_KINDS
from ._runner import invoke, invoke_compiled
from ._torch_private import functorch as _functorch
from ._torch_private import pytree


def leaf_name(leaf_id):
    leaf = LEAVES.get(leaf_id)
    if leaf is not None:
        return leaf._name
    for i, name, _ in _C.named_leaves():
        if i == leaf_id:
            return name
    return f"<id {leaf_id}>"


def _error(name, message):
    return LeafFunctionError(f"torchleaf: leaf function '{name}' {message}")


def _sample(t, dim, i):
    return t if dim is None or t is None else t.select(dim, i)


def _samples(tensors, dims, i):
    return [_sample(t, d, i) for t, d in zip(tensors, dims)]


def _check_batch(name, info, mutated_dims, inputs_dims, own_rule):
    if info.batch_size == 0:
        raise _error(name, "is called under vmap with a batch of size 0, which its per-sample loop cannot run.")
    if any(d is not None for d in inputs_dims) and any(d is None for d in mutated_dims):
        hint = " or register a vmap rule for the leaf (@f.register_vmap)" if own_rule else ""
        raise _error(
            name,
            "is called under vmap with batched inputs but an unbatched declared-mutable input: "
            "its per-sample loop would mutate that tensor once per sample. Batch the mutable "
            f"input too (vmap's in_dims){hint}.",
        )


def _stack(name, per_sample, own_rule=True):
    """Stacks column k of `per_sample` (one list of tensors per sample)."""
    out = []
    for k, column in enumerate(zip(*per_sample)):
        shape = column[0].shape
        for i, t in enumerate(column):
            if t.shape != shape:
                raise _error(
                    name,
                    f"returned output {k} of shape {list(shape)} for sample 0 but {list(t.shape)} for "
                    f"sample {i} under vmap: its per-sample loop stacks outputs, which needs equal "
                    f"shapes. Pad the outputs"
                    + (", or register a vmap rule for the leaf (@f.register_vmap)." if own_rule else "."),
                )
        out.append(torch.stack(column))
    return out


def _stack_handles(handles):
    """One handle, batched at dimension 0 over `handles` (each a state handle,
    possibly batched or wrapped by lower functorch levels)."""
    h = handles[0]
    level = _functorch.maybe_get_level(h)
    if level == -1:
        # An operator, so that a traced loop (vmap(grad(leaf)) under
        # torch.compile) stacks the real handles at run time.
        return torch.ops.torchleaf.stack_handles(handles)
    if _functorch.is_batchedtensor(h):
        inner = []
        for x in handles:
            p, bdim = _functorch._unwrap_batched(x, level)
            inner.append(p.movedim(bdim, 0))
        # [N, B, ...] batched at level `level` along B.
        return _functorch._add_batch_dim(_stack_handles(inner), 1, level)
    if _functorch.is_gradtrackingtensor(h):
        inner = [_functorch._unwrap_for_grad(x, level) for x in handles]
        return _functorch._wrap_for_grad(_stack_handles(inner), level)
    raise RuntimeError(f"torchleaf: cannot stack state handles wrapped as {type(h)}")  # pragma: no cover


def _ordered(leaf_id, plan, inputs):
    """(whether the plan returns an order token, whether `inputs` ends with one)."""
    leaf = LEAVES.get(leaf_id)
    if leaf is None:
        return False, False
    plan = leaf._plans[plan]
    return plan.ordered, plan.takes_token(len(inputs))


def _loop(
    name, info, call, inputs, in_dims, mutated, mutated_dims, ordered, own_rule, n_tail=0, token_in=False
):
    """Runs `call(inputs_i, mutated_i)` per sample; returns (stacked outputs,
    out dims, the last `n_tail` outputs of every sample). A compiled plan's
    order token (the last output when `ordered`, and the last input when
    `token_in`: not for its graph's first call) is threaded from sample to
    sample and returned unbatched."""
    _check_batch(name, info, mutated_dims, in_dims, own_rule)
    results, tails = [], []
    token = inputs[-1] if token_in else None
    for i in range(info.batch_size):
        sample_inputs = _samples(inputs, in_dims, i)
        if token_in:
            sample_inputs[-1] = token
        elif token is not None:  # samples after the first follow the one before
            sample_inputs.append(token)
        out = list(call(sample_inputs, _samples(mutated, mutated_dims, i)))
        if n_tail:
            tails.append(out[-n_tail:])
            out = out[:-n_tail]
        if ordered:
            token = out.pop()
        results.append(out)
    outputs = _stack(name, results, own_rule)
    dims: list = [0] * len(outputs)
    if ordered:
        outputs.append(token)
        dims.append(None)
    return outputs, dims, tails


def _dims(in_dims, k):
    return list(in_dims[k]) if len(in_dims) > k else []


# ------------------------------------------------------------ torchleaf::call
def _vmap_call(info, in_dims, leaf, plan, inputs):
    return _vmap_call_mutating(info, in_dims, leaf, plan, inputs, None)


def _vmap_call_mutating(info, in_dims, leaf, plan, inputs, mutated):
    mutating = mutated is not None
    mutated = list(mutated) if mutating else []
    in_d, mut_d = _dims(in_dims, 2), _dims(in_dims, 3)
    python_leaf = LEAVES.get(leaf)
    if python_leaf is not None and python_leaf._vmap_rule is not None:
        return _run_own_rule(python_leaf, info, plan, list(inputs), in_d, mutated, mut_d)
    if mutating:
        def call(i, m):
            return torch.ops.torchleaf.call_mutating(leaf, plan, i, m)
    else:
        def call(i, m):
            return torch.ops.torchleaf.call(leaf, plan, i)
    ordered, token_in = _ordered(leaf, plan, inputs)
    outputs, dims, _ = _loop(
        leaf_name(leaf), info, call, list(inputs), in_d, mutated, mut_d,
        ordered, python_leaf is not None, token_in=token_in,
    )
    return outputs, dims


# --------------------------------------------------------- torchleaf::forward
def _vmap_forward(info, in_dims, leaf, plan, inputs, differentiable):
    def call(i, m):
        outputs, state = torch.ops.torchleaf.forward(leaf, plan, i, differentiable)
        return [*outputs, state]

    outputs, dims, state, _ = _forward_loop(info, in_dims, leaf, plan, inputs, [], [], call, 0)
    return (outputs, state), (dims, 0)


def _vmap_forward_mutating(info, in_dims, leaf, plan, inputs, mutated, differentiable):
    def call(i, m):
        outputs, state = torch.ops.torchleaf.forward_mutating(leaf, plan, i, m, differentiable)
        return [*outputs, state]

    outputs, dims, state, _ = _forward_loop(info, in_dims, leaf, plan, inputs, mutated, _dims(in_dims, 3), call, 0)
    return (outputs, state), (dims, 0)


def _vmap_forward_functional(info, in_dims, leaf, plan, inputs, mutated, differentiable):
    def call(i, m):
        outputs, state, updated = torch.ops.torchleaf.forward_functional(leaf, plan, i, m, differentiable)
        return [*outputs, state, *updated]

    n = len(mutated)
    outputs, dims, state, updated = _forward_loop(
        info, in_dims, leaf, plan, inputs, mutated, _dims(in_dims, 3), call, n
    )
    return (outputs, state, updated), (dims, 0, [0] * n)


def _forward_loop(info, in_dims, leaf, plan, inputs, mutated, mutated_dims, call, n_updated):
    """The per-sample loop of a forward variant, whose `call` returns the
    outputs, the state handle, then `n_updated` new values of mutable inputs:
    (outputs, out dims, one state handle batched at 0, updated values)."""
    name = leaf_name(leaf)
    ordered, token_in = _ordered(leaf, plan, inputs)
    outputs, dims, tails = _loop(
        name, info, call, list(inputs), _dims(in_dims, 2), list(mutated), mutated_dims,
        ordered, LEAVES.get(leaf) is not None, n_tail=1 + n_updated, token_in=token_in,
    )
    state = _stack_handles([t[0] for t in tails])
    updated = _stack(name, [t[1:] for t in tails]) if n_updated else []
    return outputs, dims, state, updated


# -------------------------------------------------------- torchleaf::backward
def _vmap_backward(info, in_dims, leaf, state, grads, input_meta):
    state_dim = in_dims[1]
    grad_dims = list(in_dims[2])
    grads = list(grads)
    per_sample = []
    for i in range(info.batch_size):
        per_sample.append(
            torch.ops.torchleaf.backward(
                leaf, _sample(state, state_dim, i), _samples(grads, grad_dims, i), input_meta
            )
        )
    if not per_sample:
        raise _error(leaf_name(leaf), "is differentiated under vmap with a batch of size 0.")
    outputs = _stack(leaf_name(leaf), per_sample)
    return outputs, [0] * len(outputs)


# ---------------------------------------------------- a Python leaf's own rule
def _run_own_rule(leaf, info, plan_index, inputs, in_dims, mutated, mutated_dims):
    """Calls the leaf's registered vmap rule with the user's arguments (and
    in_dims per positional argument, as torch.library.register_vmap does);
    returns the operator's outputs and their out dims."""
    plan = leaf._plans[plan_index]
    tensors = inputs + mutated
    dims = in_dims + mutated_dims
    flat_dims = [None] * len(plan.template)
    k = 0

    def refuse(what):
        return _error(
            leaf._name,
            f"has a vmap rule, but {what} is batched; the rule gets in_dims for tensor arguments "
            f"only. Pass that value unbatched, or remove the rule to use the per-sample loop.",
        )

    for slot in plan.slots:
        pos, n = slot.position, slot.width
        if slot.kind == IN_TENSOR:
            flat_dims[pos] = dims[k]
        elif any(d is not None for d in dims[k : k + n]):
            raise refuse(f"argument {pos} (a {'module' if slot.kind in MODULE_KINDS else 'non-tensor value'})")
        k += n
    for j, pos in enumerate(plan.mutated):
        flat_dims[pos] = mutated_dims[j]
    if any(d is not None for d in mutated_dims[len(plan.mutated) :]):
        raise refuse("a module's mutable buffer")
    args_dims, kwargs_dims = pytree.tree_unflatten(flat_dims, plan.spec)
    if any(d is not None for d in pytree.tree_leaves(kwargs_dims)):
        raise refuse("a keyword argument")
    rule = leaf._vmap_rule

    def run(*args, **kwargs):
        return rule(info, tuple(args_dims), *args, **kwargs)

    try:
        run_rule = invoke_compiled if plan.ordered else invoke  # autocast as traced
        result = run_rule(leaf, run, plan, tensors, None, fake=False)
    except BaseException as e:
        add_note(e, f"raised inside the vmap rule of leaf function '{leaf._name}'")
        raise
    if not isinstance(result, tuple) or len(result) != 2:
        raise _error(
            leaf._name,
            f"has a vmap rule that returned a {type(result).__name__}; a vmap rule returns "
            f"(outputs, out_dims), as for torch.library.register_vmap.",
        )
    out, out_dims = result
    flat, desc = outputs.flatten_output(leaf, out)
    leaves, spec = pytree.tree_flatten(out)
    flat_out_dims = pytree._broadcast_to_and_flatten(out_dims, spec)
    if flat_out_dims is None:
        raise _error(
            leaf._name,
            f"has a vmap rule whose out_dims ({out_dims!r}) do not match its outputs' structure "
            f"({spec}); give an int or None per output (or one for all).",
        )
    out_dims = [d for x, d in zip(leaves, flat_out_dims) if isinstance(x, torch.Tensor)]
    plan.check_output(leaf, desc)
    if plan.ordered:
        flat = flat + [torch.empty(0, dtype=torch.int64)]  # a new order token
        out_dims = out_dims + [None]
    return flat, out_dims


def set_vmap_rule(leaf, rule):
    leaf._vmap_rule = rule


def register_rules():
    """Batching rules of torchleaf's own operators."""
    for name, rule in (
        ("call", _vmap_call),
        ("call_mutating", _vmap_call_mutating),
        ("forward", _vmap_forward),
        ("forward_mutating", _vmap_forward_mutating),
        ("forward_functional", _vmap_forward_functional),
        ("backward", _vmap_backward),
    ):
        torch.library.register_vmap(f"torchleaf::{name}", rule)


def register_named_rule(name, mutable):
    """The per-sample loop for a C++ leaf's named operator ``ns::name``."""
    namespace, opname = name.split("::")
    op = getattr(getattr(torch.ops, namespace), opname).default

    def rule(info, in_dims, inputs, mutated=None):
        mutating = mutated is not None

        def call(i, m):
            return op(i, m) if mutating else op(i)

        outputs, dims, _ = _loop(
            name, info, call, list(inputs), _dims(in_dims, 0), list(mutated or ()), _dims(in_dims, 1),
            False, False,
        )
        return outputs, dims

    torch.library.register_vmap(name, rule)
