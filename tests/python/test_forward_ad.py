"""Forward-mode AD through leaf functions is never silent: a jvp or a dual
tensor either gets the undecorated function's tangent or a clear
LeafFunctionError naming the leaf (today: the error; the captured graph only
runs backward). Before, torch.func.jvp returned zero tangents and make_dual
outputs had no tangent."""

import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torchleaf
from torchleaf import LeafFunctionError


def body(x):
    return (x * 3).sin()


py_leaf = torchleaf.leaf_function(body)
py_leaf.register_fake(torch.empty_like)


@pytest.fixture(params=["python", "cpp"])
def leaf(request, cpp_leaves):
    """(name pattern, function): the same f(x) = sin(3x) as a Python leaf
    (named after its module and qualname) and as the C++ leaf
    torchleaf_test::sin3."""
    if request.param == "python":
        return r"[\w.]*\bbody", py_leaf
    ops, _ = cpp_leaves
    return "torchleaf_test::sin3", lambda x: ops.sin3([x])[0]


def clear_message(name):
    return (
        rf"leaf function '{name}' received a forward-mode AD tangent at input \d+, but "
        rf"forward-mode AD \(jvp, make_dual\) is not supported through leaf function '{name}'"
    )


def clear_error(name):
    return pytest.raises(LeafFunctionError, match=clear_message(name))


def right_or_clear_error(name, compute, expected):
    """`compute()` returns the tangent(s) `expected()` gives for the
    undecorated function, or raises the clear error; nothing else."""
    try:
        got = compute()
    except LeafFunctionError as e:
        assert re.search(clear_message(name), str(e)), str(e)
        return False
    torch.testing.assert_close(got, expected())
    return True


def still_usable(fn):
    x = torch.randn(5, requires_grad=True)
    torch.testing.assert_close(fn(x), body(x))
    (g,) = torch.autograd.grad(fn(x).sum(), x)
    torch.testing.assert_close(g, 3 * torch.cos(3 * x.detach()))
    assert torchleaf.live_states() == 0


def test_jvp(leaf):
    name, fn = leaf
    x, v = torch.randn(5), torch.randn(5)
    right_or_clear_error(
        name, lambda: torch.func.jvp(fn, (x,), (v,)), lambda: torch.func.jvp(body, (x,), (v,))
    )
    right_or_clear_error(name, lambda: torch.func.jacfwd(fn)(x), lambda: torch.func.jacfwd(body)(x))
    still_usable(fn)


def test_make_dual(leaf):
    name, fn = leaf
    x, v = torch.randn(5), torch.randn(5)

    def tangent_of(f, primal):
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(fwAD.make_dual(primal, v))).tangent

    right_or_clear_error(name, lambda: tangent_of(fn, x), lambda: tangent_of(body, x))
    # Inputs that also require grad take the differentiable path; views of
    # a dual tensor carry its tangent too; no_grad changes nothing.
    xr = x.clone().requires_grad_()
    right_or_clear_error(name, lambda: tangent_of(fn, xr), lambda: tangent_of(body, xr))
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.randn(6), torch.randn(6))
        right_or_clear_error(
            name,
            lambda: fwAD.unpack_dual(fn(dual[1:])).tangent,
            lambda: fwAD.unpack_dual(body(dual[1:])).tangent,
        )
        with torch.no_grad():
            right_or_clear_error(
                name,
                lambda: fwAD.unpack_dual(fn(dual)).tangent,
                lambda: fwAD.unpack_dual(body(dual)).tangent,
            )
        # A tensor without a tangent is an ordinary call, even inside a level.
        torch.testing.assert_close(fn(x), body(x))
    still_usable(fn)


def test_today_it_is_the_clear_error(leaf):
    """Pins today's behaviour, so that a change (a real tangent) is
    deliberate: update this test and docs/errors.md together."""
    name, fn = leaf
    x, v = torch.randn(5), torch.randn(5)
    with clear_error(name):
        torch.func.jvp(fn, (x,), (v,))
    with fwAD.dual_level(), clear_error(name):
        fn(fwAD.make_dual(x, v))
    still_usable(fn)


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda f, x, v: torch.func.jvp(lambda y: torch.func.jvp(f, (y,), (v,))[1], (x,), (v,)), id="jvp-of-jvp"),
        pytest.param(lambda f, x, v: torch.func.grad(lambda y: torch.func.jvp(f, (y,), (v,))[1].sum())(x), id="grad-of-jvp"),
        pytest.param(lambda f, x, v: torch.func.vmap(lambda y: torch.func.jvp(f, (y,), (y,)))(x.view(5, 1)), id="vmap-of-jvp"),
    ],
)
def test_nested_transforms_with_a_jvp_inside(leaf, transform):
    name, fn = leaf
    x, v = torch.randn(5), torch.randn(5)
    right_or_clear_error(name, lambda: transform(fn, x, v), lambda: transform(body, x, v))
    still_usable(fn)


def test_a_tangent_on_a_declared_mutable_input(cpp_leaves):
    ops, _ = cpp_leaves
    x, counter = torch.randn(4), torch.zeros(())
    with fwAD.dual_level(), clear_error("torchleaf_test::count_calls"):
        ops.count_calls([x], [fwAD.make_dual(counter, torch.ones(()))])
    with fwAD.dual_level(), clear_error("torchleaf_test::count_calls"):
        ops.count_calls([fwAD.make_dual(x, torch.ones(4))], [counter])
    assert counter.item() == 0  # refused before the real function ran
    torch.testing.assert_close(ops.count_calls([x], [counter])[0], x.sin())
    assert counter.item() == 1


def test_the_operators_as_compiled_graphs_call_them():
    """A compiled step calls torchleaf::forward and ::backward with grad mode
    off, which the direct entries run without the dispatcher
    (forward_plain, backward_plain): a tangent on an input or on a gradient
    is the same clear error as through the operators' Autograd kernels."""
    from _graphs import compiled_call_site

    _, plan = compiled_call_site(py_leaf, torch.randn(5))  # a compiled call's: outputs [out, token]
    forward, backward = torch.ops.torchleaf.forward.default, torch.ops.torchleaf.backward.default
    x, v = torch.randn(5), torch.randn(5)
    meta = [6, 0, -1, 1, 5]  # (the gradient's dtype, device and size)
    with torch.no_grad():
        (out, _), handle = forward(py_leaf._id, plan, [x], [0])
        torch.testing.assert_close(out, body(x))
        with fwAD.dual_level():
            with clear_error(r"[\w.]*\bbody"):
                forward(py_leaf._id, plan, [fwAD.make_dual(x, v)], [0])
            with clear_error(r"[\w.]*\bbody"):
                backward(py_leaf._id, handle, [fwAD.make_dual(torch.ones(5), v), None], meta)
        (g,) = backward(py_leaf._id, handle, [torch.ones(5), None], meta)
    torch.testing.assert_close(g, 3 * torch.cos(3 * x))
    del handle
    still_usable(py_leaf)
