"""Autograd through leaf functions: gradients against the undecorated
function, per-invocation state (also under AOTAutograd, where PyTorch's
built-in leaf_function fails), retain_graph, double backward, lifetimes and
escaped gradients."""

import gc
import threading

import pytest
import torch
from functorch.compile import aot_function, nop
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

import torchleaf
from torchleaf import LeafFunctionError


def _leaf(fn, fake=None):
    leaf = torchleaf.leaf_function(fn)
    if fake is not None:
        leaf.register_fake(fake)
    return leaf


def elementwise(x, y):
    return (x * y).sin() + x.exp()


def matmul(x, w):
    return torch.tanh(x @ w)


def reductions(x):
    return x.sum(), x.pow(2).mean(0), x.logsumexp(1)


def pytree_in(d, pair):
    return {"a": d["x"] * pair[0] + pair[1].sum(), "b": [d["x"].cumsum(0)]}


def double64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize(
    "fn,make_inputs",
    [
        (elementwise, lambda: (double64(4), double64(4))),
        (matmul, lambda: (double64(3, 4), double64(4, 2))),
        (reductions, lambda: (double64(3, 4),)),
    ],
    ids=["elementwise", "matmul", "reductions"],
)
def test_gradcheck_and_gradgradcheck(fn, make_inputs):
    leaf = _leaf(fn)
    inputs = make_inputs()
    for got, want in zip(torch.utils._pytree.tree_leaves(leaf(*inputs)), torch.utils._pytree.tree_leaves(fn(*inputs))):
        torch.testing.assert_close(got, want)
    assert gradcheck(leaf, inputs)
    assert gradgradcheck(leaf, inputs)


def test_gradcheck_pytree_inputs_and_module():
    leaf = _leaf(pytree_in)
    x, s, t = double64(5), double64(()), double64(3)

    def flat(x, s, t):
        return torch.utils._pytree.tree_leaves(leaf({"x": x}, (s, t)))

    assert gradcheck(flat, (x, s, t))
    assert gradgradcheck(flat, (x, s, t))

    mod = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    run = _leaf(lambda m, x: m(x))
    x = double64(5, 3)
    params = list(mod.parameters())

    def through_module(x, *ps):
        with torch.nn.utils.stateless._reparametrize_module(mod, dict(zip([n for n, _ in mod.named_parameters()], ps))):
            return run(mod, x)

    assert gradcheck(through_module, (x, *params))
    # Parameter gradients equal the undecorated module's.
    run(mod, x).pow(2).sum().backward()
    got = [p.grad.clone() for p in params]
    mod.zero_grad()
    mod(x).pow(2).sum().backward()
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad)


def test_unused_inputs_get_no_gradient_and_non_differentiable_outputs():
    leaf = _leaf(lambda x, unused: (x * 2, x.argmax(), torch.ones(2)))
    x, unused = torch.randn(3, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    a, idx, const = leaf(x, unused)
    assert idx.dtype == torch.int64 and not idx.requires_grad
    # As with the plain function: an output that depends on no input does
    # not require grad (it did when some differentiable input went unused).
    assert a.requires_grad and not const.requires_grad
    # As with the plain function, the unused input gets no gradient: None
    # with allow_unused, an error without, and .grad stays None.
    gx, gu = torch.autograd.grad(a.sum() + const.sum(), (x, unused), retain_graph=True, allow_unused=True)
    torch.testing.assert_close(gx, torch.full((3,), 2.0))
    assert gu is None
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(a.sum(), (x, unused), retain_graph=True)
    a.sum().backward()
    assert unused.grad is None
    # Only the unused input requires grad: nothing does.
    assert not any(t.requires_grad for t in leaf(x.detach(), unused))


def _accumulation(f, compiled):
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    x1 = torch.randn(2, 4, requires_grad=True)
    x2 = (torch.randn(2, 4) * 3).requires_grad_()
    g = aot_function(f, fw_compiler=nop, bw_compiler=nop) if compiled else f
    out1 = g(x1, w)
    out2 = g(x2, w)  # two forwards in flight
    out1.sum().backward()
    gw1 = w.grad.clone()
    out2.sum().backward()
    return gw1, w.grad - gw1, x1.grad, x2.grad


def _body(x, w):
    return (x @ w).tanh() * x.sum()


def _body_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_function"])
def test_two_forwards_in_flight_keep_their_own_state(compiled):
    expected = _accumulation(_body, compiled=False)
    got = _accumulation(_leaf(_body, _body_fake), compiled)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_builtin_leaf_function_fails_two_forwards_in_flight():
    """Recorded result for PyTorch 2.13's own leaf_function: under
    aot_function its state is one slot per call site, so the second backward
    finds the first backward's freed graph and raises (eager works)."""
    from torch._dynamo.decorators import leaf_function as builtin_leaf_function

    builtin = builtin_leaf_function(_body)
    builtin.register_fake(_body_fake)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _accumulation(builtin, compiled=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_function"])
def test_retain_graph_then_second_backward_accumulates(compiled):
    leaf = _leaf(_body, _body_fake)
    f = aot_function(leaf, fw_compiler=nop, bw_compiler=nop) if compiled else leaf
    x = torch.randn(2, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    loss = f(x, w).sum()
    loss.backward(retain_graph=True)
    once = x.grad.clone(), w.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * once[0])
    torch.testing.assert_close(w.grad, 2 * once[1])
    del loss
    assert torchleaf.live_states() == 0


def test_double_backward_matches_the_function():
    leaf = _leaf(_body, _body_fake)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def second(f):
        gx, gw = torch.autograd.grad(f(x, w).pow(2).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(gx.sin().sum() + gw.pow(2).sum(), (x, w))

    for got, want in zip(second(leaf), second(_body)):
        torch.testing.assert_close(got, want)


def test_released_state_is_a_clear_error():
    """Eager calls attach their captured graph to the caller's, so a second
    backward without retain_graph=True meets PyTorch's own check."""
    leaf = _leaf(_body, _body_fake)
    x = torch.randn(2, 4, requires_grad=True)
    loss = leaf(x, torch.randn(4, 3)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()
    del loss
    assert torchleaf.live_states() == 0
    # The process stays usable.
    x.grad = None
    w = torch.randn(4, 3)
    leaf(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(_body(x, w).sum(), x)[0])


_RELEASED = (
    r"leaf function '[\w.<>]*\.{}' cannot run backward: its autograd state was already released "
    r"by an earlier backward\. Pass retain_graph=True to the first backward"
)


@pytest.mark.parametrize("how", ["make_fx", "dispatch_mode"])
def test_second_backward_of_a_recorded_call_is_a_leaf_function_error(how):
    """Calls seen by a tracer or a dispatch mode record torchleaf's backward
    node, which drops the call's state after a backward without
    retain_graph=True; backpropagating through it again is torchleaf's own
    error, and nothing is left behind."""

    def released_twice(x):
        return x * 2  # saves no tensor: only torchleaf's check can fire

    leaf = _leaf(released_twice, torch.empty_like)
    x = torch.ones(3, requires_grad=True)

    def grads(x, retain):
        loss = leaf(x).sum()
        first = torch.autograd.grad(loss, x, retain_graph=retain)[0]
        return first + torch.autograd.grad(loss, x)[0]

    if how == "make_fx":
        with pytest.raises(LeafFunctionError, match=_RELEASED.format("released_twice")):
            make_fx(lambda x: grads(x, retain=False), tracing_mode="fake")(x)
        assert torchleaf.live_states() == 0
        # The same program with retain_graph=True traces and runs.
        gm = make_fx(lambda x: grads(x, retain=True), tracing_mode="fake")(x)
        torch.testing.assert_close(gm(x), torch.full((3,), 4.0))
    else:
        with FlopCounterMode(display=False):
            loss = leaf(x).sum()
            loss.backward()
            torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
            with pytest.raises(LeafFunctionError, match=_RELEASED.format("released_twice")):
                loss.backward()
            del loss
            assert torchleaf.live_states() == 0
            x.grad = None
            leaf(x).sum().backward()  # the next call works
            torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert torchleaf.live_states() == 0
    x.grad = None
    leaf(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert torchleaf.live_states() == 0


def _traced_grad_and_state_node(name):
    """A leaf named `name` (graphs keep only its id: hold on to it), the
    make_fx graph of its gradient (forward and backward operators) and the
    graph node that holds the call's state handle."""

    def body(x):
        return x.exp()

    body.__name__ = body.__qualname__ = name
    leaf = _leaf(body, torch.empty_like)
    gm = make_fx(lambda x: torch.autograd.grad(leaf(x).sum(), x)[0], tracing_mode="fake")(
        torch.ones(3, requires_grad=True)
    )
    (backward,) = [n for n in gm.graph.nodes if n.target is torch.ops.torchleaf.backward.default]
    return leaf, gm, backward.args[1]


class _EditHandle(torch.fx.Interpreter):
    """Runs a graph, passing the state handle through `edit` on its way from
    torchleaf's forward to its backward."""

    def __init__(self, gm, state_node, edit):
        super().__init__(gm)
        self.state_node, self.edit = state_node, edit

    def run_node(self, n):
        out = super().run_node(n)
        return self.edit(out) if n is self.state_node else out


def test_a_copied_state_handle_is_a_leaf_function_error():
    """The state lives exactly as long as the handle torchleaf's forward
    returned; a copy of it (as a pass that snapshots values would make) is
    refused by backward, naming the leaf."""
    leaf, gm, state_node = _traced_grad_and_state_node("copied_handle")  # gm needs the leaf alive
    x = torch.randn(3, requires_grad=True)
    torch.testing.assert_close(gm(x), x.exp())
    refused = r"leaf function '[\w.<>]*\.copied_handle' backward received a state argument that is not a state handle"
    with pytest.raises(LeafFunctionError, match=refused):
        _EditHandle(gm, state_node, torch.clone).run(x)
    assert torchleaf.live_states() == 0
    torch.testing.assert_close(gm(x), x.exp())  # the process stays usable
    assert torchleaf.live_states() == 0


def test_writing_into_a_state_handle_does_not_retarget_it():
    """A handle owns its state through its storage's context, not through the
    number its data shows: overwriting the data (here with the number of an
    earlier, finished call) neither points backward at another state nor
    keeps this one alive."""
    leaf, gm, state_node = _traced_grad_and_state_node("retargeted")  # gm needs the leaf alive
    x = torch.randn(3, requires_grad=True)
    numbers = []
    _EditHandle(gm, state_node, lambda h: numbers.append(h.item()) or h).run(x)
    assert torchleaf.live_states() == 0  # that call's state is released
    got = _EditHandle(gm, state_node, lambda h: h.fill_(numbers[0])).run(x)
    torch.testing.assert_close(got, x.exp())
    gc.collect()
    assert torchleaf.live_states() == 0


def _rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


@pytest.mark.slow
def test_state_is_released_with_the_graph_even_without_backward():
    leaf = _leaf(lambda x, w: (x * w).sum(1), lambda x, w: x.new_empty(x.shape[0]))
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(4, 8)
    # Compiled (AOTAutograd saves the state handle for backward).
    compiled = aot_function(leaf, fw_compiler=nop, bw_compiler=nop)
    out = compiled(x, w)
    assert torchleaf.live_states() == 1
    del out  # no backward: the graph goes, and the state with it
    assert torchleaf.live_states() == 0
    # Eager calls attach the captured graph to the caller's graph directly and
    # keep no state at all.
    out = leaf(x, w)
    assert torchleaf.live_states() == 0
    del out

    def loop(f, n):
        for i in range(n):
            out = f(x, w)
            if i % 2:
                out.sum().backward()

    for f, n in ((leaf, 100_000), (compiled, 20_000)):
        loop(f, 2_000)  # warm up allocator and caches
        gc.collect()
        rss_before = _rss_kib()
        loop(f, n)
        gc.collect()
        assert torchleaf.live_states() == 0
        growth = _rss_kib() - rss_before
        assert growth < 8 * 1024, f"resident memory grew by {growth} KiB over {n} calls"


def test_a_leaf_tensor_made_inside_for_autograd_grad():
    """Forces as a leaf: the body makes its own leaf tensor to differentiate
    an energy with create_graph=True and returns the forces, whose backward
    reaches w. That leaf tensor is reported as escaped (it cannot be told
    from a closure's); the message says so and how to drop its gradient, and
    with the check off the gradients are the undecorated function's."""

    def forces(x, w):
        p = x.detach().requires_grad_()
        energy = (w * p.sin()).sum()
        (grad,) = torch.autograd.grad(energy, p, create_graph=True)
        return -grad

    x = torch.randn(5, dtype=torch.float64)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    strict = torchleaf.leaf_function(forces)
    with pytest.raises(LeafFunctionError, match=r"leaf tensor made inside the function") as info:
        strict(x, w)
    assert "check_escaped_gradients=False" in str(info.value)
    leaf = torchleaf.leaf_function(check_escaped_gradients=False)(forces)
    got = torch.autograd.grad(leaf(x, w).pow(2).sum(), w)
    torch.testing.assert_close(got, torch.autograd.grad(forces(x, w).pow(2).sum(), w))
    assert torchleaf.live_states() == 0


def test_escaped_gradients_are_counted_or_ignored():
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    @torchleaf.leaf_function
    def closes_over(x):
        return x * w + b.sum(0).float()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(LeafFunctionError, match=r"closes_over' uses 2 tensor\(s\) that require grad") as info:
        closes_over(x)
    msg = str(info.value)
    assert "closes_over' uses 2 tensor(s) that require grad but are not among its inputs" in msg
    assert "shape=[3], dtype=Float" in msg and "shape=[2, 3], dtype=Double" in msg
    assert torchleaf.live_states() == 0

    with torchleaf.config.patch(check_escaped_gradients=False):
        closes_over(x).sum().backward()
    torch.testing.assert_close(x.grad, w.detach())
    assert w.grad is None and b.grad is None  # not computed, as documented

    # A non-leaf closure (part of the caller's graph) is caught too.
    h = w * 2

    @torchleaf.leaf_function
    def uses_graph(x):
        return x + h

    with pytest.raises(LeafFunctionError, match=r"uses_graph' uses 1 tensor\(s\) that require grad"):
        uses_graph(x)


def _on_another_thread(fn):
    box = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def _chain(w, n):
    h = w
    for _ in range(n):
        h = h * 1.0
    return h


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_check_off_keeps_the_graph_of_a_closure_built_on_another_thread(backend):
    """Issue 12: with the escaped-gradient check off, membership in a call's
    graph was decided by autograd sequence numbers, which count per thread:
    a closure whose graph another thread built looked like the call's own
    nodes, and the walk cut an edge inside the caller's graph (w.grad None
    after the caller's own backward). Now the call's graph is what lies
    between its outputs and its inputs."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    h = _on_another_thread(lambda: _chain(w, 50))

    def plain(x):
        return (x * h).sin() + x

    leaf = torchleaf.leaf_function(plain, check_escaped_gradients=False)
    leaf.register_fake(lambda x: torch.empty_like(x))
    call = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = call(x)
    torch.testing.assert_close(out, plain(x))
    # The caller's own graph is whole.
    h.sum().backward(retain_graph=True)
    torch.testing.assert_close(w.grad, torch.ones_like(w))
    # The call's gradient reaches x as the undecorated function's does; w's
    # is dropped knowingly (check off).
    (gx,) = torch.autograd.grad(out.sum(), x)
    (expected,) = torch.autograd.grad(plain(x).sum(), x)
    torch.testing.assert_close(gx, expected)
    torch.testing.assert_close(w.grad, torch.ones_like(w))
    assert gradcheck(leaf, (x,))
    del out
    gc.collect()
    assert torchleaf.live_states() == 0


def test_check_off_detaches_an_output_made_only_from_escaped_tensors():
    """An output computed from closure tensors alone has no edge into the
    call's graph: with the check off it carries no gradient (none is computed
    for escaped tensors), and the caller's graph behind it stays whole."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    h = w * 2

    def plain(x):
        return x * h, h.exp()

    leaf = torchleaf.leaf_function(plain, check_escaped_gradients=False)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out, only_closure = leaf(x)
    torch.testing.assert_close((out, only_closure), plain(x))
    assert out.requires_grad and not only_closure.requires_grad
    out.sum().backward()
    torch.testing.assert_close(x.grad, h.detach())
    assert w.grad is None
    h.sum().backward()
    torch.testing.assert_close(w.grad, torch.full_like(w, 2.0))


def test_nodes_made_on_a_worker_thread_belong_to_the_call():
    """The other direction: nodes the function makes on a worker thread have
    sequence numbers below the call's. They lead to the inputs, so they are
    the call's own (the check used to report them as escaped tensors)."""

    def plain(x):
        return _on_another_thread(lambda: x * 3.0).sin()

    leaf = torchleaf.leaf_function(plain)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    _chain(x, 200)  # this thread's sequence numbers run ahead of the worker's
    out = leaf(x)
    torch.testing.assert_close(out, plain(x))
    (gx,) = torch.autograd.grad(out.sum(), x)
    (expected,) = torch.autograd.grad(plain(x).sum(), x)
    torch.testing.assert_close(gx, expected)
    assert gradcheck(leaf, (x,))


def test_closure_gradients_without_differentiable_inputs_are_an_error():
    """No input requires grad, but the function computes from a closure tensor
    that does: its gradient would be dropped, so the check reports it."""
    w = torch.randn(3, requires_grad=True)

    @torchleaf.leaf_function
    def scales(x):
        return x * w

    x = torch.randn(3)
    with pytest.raises(LeafFunctionError, match=r"scales' returned an output that requires grad although none of its inputs does"):
        scales(x)
    with torch.no_grad():  # no gradient wanted: fine
        torch.testing.assert_close(scales(x), x * w)
    with torchleaf.config.patch(check_escaped_gradients=False):  # dropped knowingly
        out = scales(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, (x * w).detach())

    @torchleaf.leaf_function
    def makes_a_parameter(x):  # a fresh leaf tensor has no history to lose
        return torch.zeros_like(x).requires_grad_()

    assert not makes_a_parameter(x).requires_grad


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_closure_gradients_without_differentiable_inputs_are_an_error(backend):
    """As in eager (above), under every backend. AOTAutograd runs a graph
    none of whose inputs requires grad, and the forward of a training graph,
    with grad mode off: a call traced with grad mode on runs its function
    with it on, so that an output computed from a closure that requires grad
    is reported instead of losing its gradient silently."""
    torch._dynamo.reset()
    w = torch.randn(3, requires_grad=True)
    calls = []

    @torchleaf.leaf_function
    def scales(x):
        calls.append(1)
        return x * w

    scales.register_fake(torch.empty_like)
    x, y = torch.randn(3), torch.randn(3, requires_grad=True)
    message = r"scales' returned an output that requires grad although none of its inputs does"

    inference = torch.compile(lambda x: scales(x).sum(), backend=backend, fullgraph=True)
    with pytest.raises(LeafFunctionError, match=message):
        inference(x)
    # In a training graph (another input requires grad), the leaf's inputs
    # still do not.
    training = torch.compile(lambda x, y: scales(x).sum() + (y * 2).sum(), backend=backend, fullgraph=True)
    with pytest.raises(LeafFunctionError, match=message):
        training(x, y)

    with torch.no_grad():  # no gradient wanted: fine, as in eager
        torch.testing.assert_close(inference(x), (x * w).sum())

    def no_grad_inside(x):
        with torch.no_grad():
            return scales(x)

    torch.testing.assert_close(torch.compile(no_grad_inside, backend=backend, fullgraph=True)(x), x * w)
    with torchleaf.config.patch(check_escaped_gradients=False):  # dropped knowingly
        torch._dynamo.reset()
        out = torch.compile(lambda x: scales(x) + 1, backend=backend, fullgraph=True)(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, (x * w + 1).detach())

    # Without a closure that requires grad, nothing changes: values, and one
    # real call per compiled call.
    torch._dynamo.reset()
    w.requires_grad_(False)
    calls.clear()
    for compiled, args in ((inference, (x,)), (training, (x, y))):
        torch.testing.assert_close(compiled(*args), (x * w).sum() + (2 * y.sum() if len(args) == 2 else 0))
    assert len(calls) == 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_autograd_inside_a_compiled_call_without_differentiable_inputs(backend):
    """Forces from an energy by torch.autograd.grad inside the function, in a
    compiled inference step (nothing requires grad): the function runs with
    grad mode on, as in eager code, although AOTAutograd runs the graph with
    it off."""
    torch._dynamo.reset()

    def forces(x, w):
        with torch.enable_grad():  # the undecorated function under the same graph
            p = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad((w * p.sin()).sum(), p)
        return -grad

    def body(x, w):
        p = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad((w * p.sin()).sum(), p)
        return -grad

    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(lambda x, w: torch.empty_like(x))
    x, w = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    expected = -w * x.cos()
    torch.testing.assert_close(leaf(x, w), expected)
    step = torch.compile(lambda x, w: leaf(x, w) * 2, backend=backend, fullgraph=True)
    torch.testing.assert_close(step(x, w), 2 * expected)
    torch.testing.assert_close(torch.compile(lambda x, w: forces(x, w) * 2, backend=backend)(x, w), 2 * expected)
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_an_in_place_change_that_would_carry_a_gradient_is_an_error(backend):
    """``buf += x * w``: the undecorated function gives ``buf`` a history
    that reaches x and w; a leaf's caller gets the new data but not that
    history, so the gradient would be lost silently. The call says so,
    whether the gradient comes from an input or a closure."""
    torch._dynamo.reset()
    w = torch.randn(3, requires_grad=True)

    def from_input(buf, x):
        buf.add_(x * 3)
        return x * 2

    def from_closure(buf, x):
        buf.add_(x * w)
        return x * 2

    def detached(buf, x):
        buf.add_(x.detach() * w.detach())
        return x * 2

    def compiled(fn):
        leaf = torchleaf.leaf_function(fn, mutates_args={"buf"})
        leaf.register_fake(lambda buf, x: torch.empty_like(x))
        return leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)

    message = r"changed its declared-mutable tensor 0 \(counting from 0: the tensor arguments mutates_args names, in parameter order, then the buffers of the modules it names\) in place with a value that has autograd history"
    for fn, x in ((from_input, torch.randn(3, requires_grad=True)), (from_closure, torch.randn(3))):
        with pytest.raises(LeafFunctionError, match=fn.__name__ + "' " + message):
            compiled(fn)(torch.zeros(3), x)
    x = torch.randn(3, requires_grad=True)
    buf = torch.zeros(3)
    out = compiled(detached)(buf, x)
    torch.testing.assert_close(buf, (x * w).detach())
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with torchleaf.config.patch(check_escaped_gradients=False):  # dropped knowingly
        buf = torch.zeros(3)
        torch._dynamo.reset()
        compiled(from_closure)(buf, x.detach())
        torch.testing.assert_close(buf, (x * w).detach())
        assert not buf.requires_grad
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("backend", [None, "aot_function", "aot_eager", "inductor"])
def test_a_hook_the_function_puts_on_its_input_runs(backend):
    """x.register_hook inside the body (gradient scaling, logging): eager
    calls wired the captured graph past the input's node, so the hook never
    ran and the gradient came back unscaled. An input without a hook (b)
    shares the call's sink node with the hooked ones: its gradient passes
    through unchanged."""
    torch._dynamo.reset()
    seen = []

    def body(x, w, b):
        x.register_hook(lambda g: g * 10)
        w.register_hook(lambda g: seen.append(g.clone()))
        return (x * w).sin() * b, w.exp()

    leaf = _leaf(body, lambda x, w, b: (torch.empty_like(x), torch.empty_like(w)))
    if backend == "aot_function":
        leaf = aot_function(leaf, fw_compiler=nop, bw_compiler=nop)
    elif backend is not None:
        leaf = torch.compile(leaf, backend=backend, fullgraph=True)
    x = torch.randn(3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64)

    def grads(f):
        # Fresh leaves each time: the plain function's hooks stay on the
        # caller's tensors (a leaf's stay on its own aliases, for one call).
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        a, c = f(xs, ws, bs)
        # (.backward(), not autograd.grad: the replay then takes its inline
        # path, which leaves sinks with hooks to the engine.)
        ((a * torch.arange(3.0, dtype=torch.float64)).sum() + c.sum()).backward()
        return xs.grad, ws.grad, bs.grad

    want = grads(body)
    assert len(seen) == 1
    got = grads(leaf)
    torch.testing.assert_close(got, want)
    assert len(seen) == 2
    torch.testing.assert_close(seen[1], seen[0])
    assert torchleaf.live_states() == 0


def test_an_eager_call_gives_the_function_its_leaf_inputs_as_they_are():
    """An eager call that records autograd passes leaf tensors (a module's
    parameters) to the function as they are, as the plain function gets
    them: the function's graph accumulates into their .grad itself, with no
    alias per parameter and call. Gradients are the plain function's, also
    for one tensor passed twice beside an activation, and a body that
    trains its module inside (its own backward through the parameters)
    does what the plain function does."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    leaves = (*lin.parameters(), w, x)

    def body(m, h, a, b):
        return m(h) * a + b.exp()

    leaf = _leaf(body, lambda m, h, a, b: torch.empty_like(h))

    def grads(f):
        for t in leaves:
            t.grad = None
        f(lin, x * 2, w, w).sum().backward()  # (x * 2: not a leaf)
        return [t.grad.clone() for t in leaves]

    torch.testing.assert_close(grads(leaf), grads(body))
    assert gradcheck(lambda x, w: leaf(lin, x, w, w), (x, w))

    def trains_inside(m, h):
        m(h).pow(2).sum().backward()
        with torch.no_grad():
            return m(h) - m.weight.grad.sum()

    trains = _leaf(trains_inside, lambda m, h: torch.empty_like(h))

    def after_a_step(f):
        for t in leaves:
            t.grad = None
        out = f(lin, x.detach())
        return out, lin.weight.grad.clone(), lin.bias.grad.clone()

    torch.testing.assert_close(after_a_step(trains), after_a_step(trains_inside))
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_call_gives_the_function_its_parameters_as_they_are(backend):
    """A compiled call passes a module's parameters to the function as they
    are too (no alias per parameter and call); its captured graph still
    ends in the call's own sink, so the compiled backward gets their
    gradients from the replay and accumulates them once: a hook on a
    parameter runs once per backward, as with the plain model. The blocks'
    activations, which a compiled forward holds without grad, are not
    leaves to pass through: each block's input gets its gradient."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

    seen = []

    def layer(block, x):
        if id(block) in own:  # (not the plain model's)
            seen.append(type(block.lin.weight) is nn.Parameter and block.lin.weight is own[id(block)])
        return block.norm(block.lin(x)).relu() + x

    leaf = _leaf(layer, lambda block, x: torch.empty_like(x))
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(3)])
    plain = nn.ModuleList([Block() for _ in range(3)])
    plain.load_state_dict(blocks.state_dict())
    own = {id(b): b.lin.weight for b in blocks}
    hooked = []
    blocks[1].lin.weight.register_hook(lambda g: hooked.append(1) or g * 2)
    plain[1].lin.weight.register_hook(lambda g: g * 2)

    def model(blocks, x, fn):
        for b in blocks:
            x = fn(b, x)
        return x.square().sum()

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(5, 4, requires_grad=True)
    for step in range(2):
        for m in (blocks, plain):
            m.zero_grad(set_to_none=True)
        compiled(blocks, x, leaf).backward()
        got = [x.grad] + [p.grad for p in blocks.parameters()]
        x.grad = None
        model(plain, x, layer).backward()
        want = [x.grad] + [p.grad for p in plain.parameters()]
        x.grad = None
        torch.testing.assert_close(got, want)
        assert len(hooked) == step + 1
    assert seen and all(seen)
    assert torchleaf.live_states() == 0


def test_compiled_backward_paths_agree():
    """Traced backward replays small CPU graphs inline and everything else
    with the autograd engine (restricted backward, anomaly mode, hooks);
    both give the undecorated function's gradients."""

    def fan_out(x, w, unused):
        y = (x @ w).sin()
        return y * y + y, (y.exp() * x.sum()).sum()  # shared subexpression, two outputs

    leaf = _leaf(fan_out, lambda x, w, u: (x.new_empty(x.shape[0], w.shape[1]), x.new_empty(())))
    compiled = aot_function(leaf, fw_compiler=nop, bw_compiler=nop)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(5, dtype=torch.float64, requires_grad=True)

    def loss(f):
        a, b = f(x, w, unused)
        return (a * torch.arange(6.0, dtype=torch.float64).view(3, 2)).sum() + b

    want = torch.autograd.grad(loss(fan_out), (x, w))
    for x_ in (x, w, unused):
        x_.grad = None
    loss(compiled).backward()  # inline replay
    torch.testing.assert_close((x.grad, w.grad), want)
    torch.testing.assert_close(unused.grad, torch.zeros(5, dtype=torch.float64))
    restricted = torch.autograd.grad(loss(compiled), (x, w))  # engine replay
    torch.testing.assert_close(restricted, want)
    with torch.autograd.detect_anomaly():
        torch.testing.assert_close(torch.autograd.grad(loss(compiled), (x, w)), want)


def test_sparse_inputs_and_outputs():
    """Sparse tensors have no storage: the output aliasing check asked for
    one and raised "Cannot access storage of SparseTensorImpl" after the
    body had run, naming no leaf."""

    def spmm(x, y):
        return torch.sparse.mm(x, y) * 2

    leaf = torchleaf.leaf_function(spmm)
    x = torch.randn(3, 3, dtype=torch.float64).to_sparse().requires_grad_()
    y = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(spmm(x, y).sum(), (x, y))
    got = torch.autograd.grad(leaf(x, y).sum(), (x, y))
    assert got[0].layout == torch.sparse_coo
    torch.testing.assert_close(got[0].to_dense(), expected[0].to_dense())
    torch.testing.assert_close(got[1], expected[1])

    sparsify = torchleaf.leaf_function(lambda d: (d * 3).to_sparse())
    d = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    out = sparsify(d)
    assert out.layout == torch.sparse_coo
    torch.testing.assert_close(out.to_dense(), d.detach() * 3)
    (grad,) = torch.autograd.grad(torch.sparse.sum(out), d)
    torch.testing.assert_close(grad, torch.full_like(d, 3.0))
    assert torchleaf.live_states() == 0
