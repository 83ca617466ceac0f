"""torch.func transforms over leaf functions: vmap (a per-sample loop by
default, or a Python leaf's own rule from @f.register_vmap), grad, jacrev and
per-sample gradients (vmap of grad) give the undecorated function's values
and gradients, for Python and C++ leaves. What stays unsupported (a second
derivative, forward-mode AD, outputs whose shape differs per sample) is a
clear LeafFunctionError naming the leaf. Before, vmap failed with "Batching
rule not implemented" and grad with "Cannot access storage of
TensorWrapper"."""

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacrev, vmap

import torchleaf
from torchleaf import LeafFunctionError


def sin3(x):
    return (x * 3).sin()


def sin3_times(x, w):
    return (x * 3).sin() * w


py_sin3 = torchleaf.leaf_function(sin3)
py_sin3.register_fake(torch.empty_like)
py_sin3_times = torchleaf.leaf_function(sin3_times)
py_sin3_times.register_fake(lambda x, w: torch.empty_like(x))


@pytest.fixture(params=["python", "cpp"])
def leaf(request, cpp_leaves):
    """(name pattern, f(x) = sin(3x), g(x, w), the undecorated g): as Python
    leaves, and as the C++ leaves torchleaf_test::sin3 and
    torchleaf_test::scale_bias (g(x, b) = 2x + b)."""
    if request.param == "python":
        return r"[\w.]*\bsin3", py_sin3, py_sin3_times, sin3_times
    ops, lib = cpp_leaves
    lib.torchleaf_test_set_scale(2.0)
    return (
        "torchleaf_test::sin3",
        lambda x: ops.sin3([x])[0],
        lambda x, b: ops.scale_bias([x, b])[0],
        lambda x, b: x * 2 + b,
    )


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def loss(f):
    return lambda x: f(x).pow(2).sum()


def test_vmap(leaf):
    _, f, g, g_body = leaf
    x, w = randn(4, 3), randn(3)
    torch.testing.assert_close(vmap(f)(x), vmap(sin3)(x))
    torch.testing.assert_close(vmap(f, in_dims=1)(x), vmap(sin3, in_dims=1)(x))
    # An unbatched extra argument is passed as it is.
    torch.testing.assert_close(vmap(g, in_dims=(0, None))(x, w), vmap(g_body, in_dims=(0, None))(x, w))
    w4 = randn(4)
    torch.testing.assert_close(vmap(g, in_dims=(1, None))(x, w4), vmap(g_body, in_dims=(1, None))(x, w4))
    w3 = randn(3)
    torch.testing.assert_close(vmap(g, in_dims=(1, 0))(x, w3), vmap(g_body, in_dims=(1, 0))(x, w3))
    x3 = randn(2, 3, 2)
    torch.testing.assert_close(vmap(vmap(f))(x3), vmap(vmap(sin3))(x3))
    # Reverse mode through the vmapped leaf, with and without functorch.
    xr = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(vmap(f)(xr).sum(), xr)
    torch.testing.assert_close(got, 3 * torch.cos(3 * x))
    torch.testing.assert_close(
        grad(lambda w: vmap(g, in_dims=(0, None))(x, w).pow(2).sum())(w),
        grad(lambda w: vmap(g_body, in_dims=(0, None))(x, w).pow(2).sum())(w),
    )


def test_grad_and_jacrev(leaf):
    _, f, g, g_body = leaf
    x, w = randn(5), randn(5)
    torch.testing.assert_close(grad(loss(f))(x), grad(loss(sin3))(x))
    torch.testing.assert_close(jacrev(f)(x), jacrev(sin3)(x))
    both = (0, 1)
    torch.testing.assert_close(
        grad(lambda x, w: g(x, w).pow(2).sum(), argnums=both)(x, w),
        grad(lambda x, w: g_body(x, w).pow(2).sum(), argnums=both)(x, w),
    )
    torch.testing.assert_close(jacrev(g, argnums=both)(x, w), jacrev(g_body, argnums=both)(x, w))
    # Value and gradient together; a leaf output used twice.
    got = torch.func.grad_and_value(lambda x: f(x).sum() * f(x).sum())(x)
    torch.testing.assert_close(got, torch.func.grad_and_value(lambda x: sin3(x).sum() * sin3(x).sum())(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_transforms_inside_a_compiled_function(leaf, backend):
    """torch.func.grad, vjp, jacrev and per-sample gradients of a leaf, traced
    by Dynamo. The call's order token came back wrapped at grad's level and
    was stored to a global, a graph output AOTAutograd could not read
    ("Cannot access storage of TensorWrapper"); the per-sample loop stacked
    its state handles outside any operator, which a trace cannot record
    (stack_state_handles met fake handles)."""
    _, f, g, g_body = leaf
    x, w = randn(5), randn(3)
    programs = {
        "grad": lambda f, g, x: grad(loss(f))(x),
        "vjp": lambda f, g, x: torch.func.vjp(f, x)[1](torch.ones_like(x))[0],
        "jacrev": lambda f, g, x: jacrev(f)(x),
        "vmap_grad": lambda f, g, x: vmap(grad(loss(f)))(x.view(5, 1) * x[:3]),
        "vmap_grad_of_unbatched": lambda f, g, x: vmap(
            grad(lambda w, x: g(x, w).pow(2).sum()), in_dims=(None, 0)
        )(w, x.view(5, 1) * x[:3]),
    }
    for name, program in programs.items():
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: program(f, g, x), backend=backend, fullgraph=True)
        for _ in range(2):  # the graph reruns with the next call's states
            torch.testing.assert_close(compiled(x), program(sin3, g_body, x), msg=name)
            assert torchleaf.live_states() == 0


def test_per_sample_gradients(leaf):
    _, f, g, g_body = leaf
    x, w = randn(6, 3), randn(3)
    torch.testing.assert_close(vmap(grad(loss(f)))(x), vmap(grad(loss(sin3)))(x))
    torch.testing.assert_close(vmap(grad(loss(f)), in_dims=1)(x), vmap(grad(loss(sin3)), in_dims=1)(x))
    # Per-sample gradients of an unbatched argument.
    per_sample_w = grad(lambda w, x: g(x, w).pow(2).sum())
    per_sample_w_body = grad(lambda w, x: g_body(x, w).pow(2).sum())
    torch.testing.assert_close(
        vmap(per_sample_w, in_dims=(None, 0))(w, x), vmap(per_sample_w_body, in_dims=(None, 0))(w, x)
    )
    # Per-sample Jacobians, and nested batches.
    torch.testing.assert_close(vmap(jacrev(f))(x), vmap(jacrev(sin3))(x))
    x3 = randn(2, 3, 4)
    torch.testing.assert_close(vmap(vmap(grad(loss(f))))(x3), vmap(vmap(grad(loss(sin3))))(x3))
    assert torchleaf.live_states() == 0


class _Head(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2, dtype=torch.float64)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.linear, x)


def _head(module, x):
    return torch.tanh(module(x))


_py_head = torchleaf.leaf_function(_head)
_py_head.register_fake(lambda module, x: x.new_empty(x.shape[:-1] + (2,)))


def test_per_sample_gradients_of_module_parameters():
    """The torch.func recipe: vmap(grad(functional_call)) over a model that
    calls a leaf with its submodule."""
    model, reference = _Head(_py_head), _Head(_head)
    reference.load_state_dict(model.state_dict())
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = randn(5, 3)

    def per_sample(m):
        step = grad(lambda p, x: functional_call(m, p, (x,)).pow(2).sum())
        return vmap(step, in_dims=(None, 0))(params, x)

    got, want = per_sample(model), per_sample(reference)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name])


def scaled(x, w, *, shift=0.0):
    return x * w + shift


def test_register_vmap_is_used():
    """A Python leaf's own rule replaces the per-sample loop where no
    gradient transform runs inside the vmap, with torch.library.register_vmap's
    convention."""
    leaf = torchleaf.leaf_function(scaled)
    leaf.register_fake(lambda x, w, *, shift=0.0: torch.empty_like(x))
    calls = []

    @leaf.register_vmap
    def rule(info, in_dims, x, w, *, shift=0.0):
        calls.append((info.batch_size, in_dims, shift))
        x_dim, w_dim = in_dims
        x = x.movedim(x_dim, 0) if x_dim is not None else x
        if w_dim is not None:
            w = w.movedim(w_dim, 0).reshape((info.batch_size,) + (1,) * (x.dim() - 1))
        return scaled(x, w, shift=shift), 0

    x, w = randn(3, 4), randn(())
    got = vmap(lambda x, w: leaf(x, w, shift=1.5), in_dims=(1, None))(x, w)
    torch.testing.assert_close(got, vmap(lambda x, w: scaled(x, w, shift=1.5), in_dims=(1, None))(x, w))
    assert calls == [(4, (1, None), 1.5)]
    ws = randn(3)
    torch.testing.assert_close(vmap(leaf)(x, ws), vmap(scaled)(x, ws))
    assert calls[-1] == (3, (0, 0), 0.0)
    # Differentiated from outside the vmap: the rule's own graph.
    got = grad(lambda w: vmap(leaf, in_dims=(0, None))(x, w).pow(2).sum())(w)
    torch.testing.assert_close(got, grad(lambda w: vmap(scaled, in_dims=(0, None))(x, w).pow(2).sum())(w))
    assert len(calls) == 3
    # A gradient inside the vmap replays per-sample graphs: the loop.
    got = vmap(grad(lambda x, w: leaf(x, w).pow(2).sum()), in_dims=(0, None))(x, w)
    torch.testing.assert_close(got, vmap(grad(lambda x, w: scaled(x, w).pow(2).sum()), in_dims=(0, None))(x, w))
    assert len(calls) == 3
    # Plain calls never see the rule.
    torch.testing.assert_close(leaf(x, w), scaled(x, w))
    assert len(calls) == 3


def test_a_malformed_vmap_rule_is_a_clear_error():
    leaf = torchleaf.leaf_function(scaled)
    leaf.register_vmap(lambda info, in_dims, x, w: x * w)
    with pytest.raises(LeafFunctionError, match=r"leaf function '[\w.]*\bscaled' has a vmap rule that returned a Tensor"):
        vmap(leaf, in_dims=(0, None))(randn(2, 3), randn(()))


def clear(name, what):
    return pytest.raises(LeafFunctionError, match=rf"leaf function '{name}' {what}")


_TWICE = "is called with inputs that require grad at an outer level of differentiation, but a second derivative"
_TANGENT = r"received a forward-mode AD tangent at input \d+"


def test_what_stays_unsupported_is_a_clear_error(leaf):
    name, f, _, _ = leaf
    x = randn(4)
    with clear(name, _TWICE):
        grad(lambda x: grad(loss(f))(x).sum())(x)
    with clear(name, _TWICE):
        jacrev(jacrev(f))(x)
    with clear(name, _TANGENT):
        hessian(lambda x: f(x).sum())(x)
    with clear(name, _TANGENT):
        torch.func.jvp(f, (x,), (x,))
    # A torch.func gradient inside a computation that autograd records: the
    # gradient is right, differentiating it again (through the gradient or
    # through the leaf's output) is the error.
    xr = x.clone().requires_grad_()
    for outer_loss in (loss, lambda f: lambda x: f(x).sum()):
        got = torch.func.grad_and_value(outer_loss(lambda y: f(y + xr)))(x)
        want = torch.func.grad_and_value(outer_loss(lambda y: sin3(y + xr)))(x)
        torch.testing.assert_close(got, want)
        with clear(name, "computed a gradient that is being differentiated again, but a second derivative"):
            got[0].sum().backward()
        with clear(name, r"cannot be differentiated through the outputs of torchleaf::forward"):
            got[1].backward()
    with torch.no_grad():  # the remedy the message gives
        torch.testing.assert_close(grad(loss(lambda y: f(y + xr)))(x), grad(loss(lambda y: sin3(y + xr)))(x))
    # The leaf still works.
    torch.testing.assert_close(vmap(grad(loss(f)))(randn(2, 3)).shape, torch.Size([2, 3]))
    assert torchleaf.live_states() == 0


def test_per_sample_loop_limits_are_clear_errors(cpp_leaves):
    ops, _ = cpp_leaves
    # Outputs whose shape depends on the sample cannot be stacked.
    x = torch.tensor([[1.0, -1.0], [1.0, 2.0]])
    with clear("torchleaf_test::positives", r"returned output 0 of shape \[1\] for sample 0 but \[2\] for sample 1"):
        vmap(lambda x: ops.positives([x])[0])(x)
    # A declared-mutable input left unbatched would be mutated once per sample.
    counter = torch.zeros(())
    with clear("torchleaf_test::count_calls", "is called under vmap with batched inputs but an unbatched declared-mutable input"):
        vmap(lambda x: ops.count_calls([x], [counter])[0])(x)
    assert counter.item() == 0
    counters = torch.zeros(2)
    torch.testing.assert_close(vmap(lambda x, c: ops.count_calls([x], [c])[0])(x, counters), x.sin())
    torch.testing.assert_close(counters, torch.ones(2))
