"""The misuse table of docs/errors.md: each case raises a clear error that
names the leaf and the fix, and the process stays usable afterwards."""

import gc
import re

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchleaf
from _graphs import traced_call_site
from torchleaf import LeafFunctionError


def leaf_with_fake(fn, fake):
    leaf = torchleaf.leaf_function(fn)
    leaf.register_fake(fake)
    return leaf


def still_usable():
    ok = leaf_with_fake(lambda x: x * 2, torch.empty_like)
    x = torch.ones(3, requires_grad=True)
    ok(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert torchleaf.live_states() == 0


def no_fake():
    leaf = torchleaf.leaf_function(lambda x: x + 1)
    with FakeTensorMode():
        leaf(torch.empty(2))


def fake_structure():
    leaf = leaf_with_fake(lambda x: (x, x + 1), lambda x: torch.empty_like(x))
    with torchleaf.config.patch(validate_outputs=True):
        leaf(torch.ones(2))


def fake_shape():
    leaf = leaf_with_fake(lambda x: x.sum(0), torch.empty_like)
    with torchleaf.config.patch(validate_outputs=True):
        leaf(torch.ones(2, 3))


def fake_dtype():
    leaf = leaf_with_fake(lambda x: x.long(), torch.empty_like)
    with torchleaf.config.patch(validate_outputs=True):
        leaf(torch.ones(2))


def fake_device():
    leaf = leaf_with_fake(lambda x: x + 1, lambda x: torch.empty(x.shape, device="meta"))
    with torchleaf.config.patch(validate_outputs=True):
        leaf(torch.ones(2))


def fake_wrong_in_compiled_graph():
    # Validation off: the always-on check compares a compiled call's real
    # outputs with what the fake gave when the graph was traced.
    leaf = leaf_with_fake(lambda x: x.sum(0), torch.empty_like)
    torch.compile(lambda x: leaf(x) * 2, backend="aot_eager", fullgraph=True)(torch.ones(2, 3))


def undeclared_mutation():
    def bump(x):
        x.add_(1)
        return x * 2

    torchleaf.leaf_function(bump)(torch.ones(2))


def input_made_to_require_grad():
    def scale(x, w):
        w.requires_grad_()  # the caller's w does not require grad
        return x * w

    torchleaf.leaf_function(scale)(torch.ones(2, requires_grad=True), torch.ones(2))


def input_made_to_require_grad_no_grad_inputs():
    def scale(x, w):
        w.requires_grad_()
        return x * w

    torchleaf.leaf_function(scale)(torch.ones(2), torch.ones(2))


def multi_grad_hook():
    leaf = leaf_with_fake(lambda x: x * 2, torch.empty_like)
    leaf.register_multi_grad_hook(lambda *grads: None)


def unknown_mutates_args():
    torchleaf.leaf_function(mutates_args={"buffer"})(lambda x, buf: x)


def escaped_gradients():
    w = torch.ones(2, requires_grad=True)
    torchleaf.leaf_function(lambda x: x * w)(torch.ones(2, requires_grad=True))


def real_returns_non_tensor_for_traced_call():
    # The compiled graph expects a tensor (from the fake); the real returns None.
    def sometimes_none(x):
        return None if x.sum() < 0 else x + 1

    leaf = leaf_with_fake(sometimes_none, torch.empty_like)
    compiled = torch.compile(lambda x: leaf(x), backend="eager", fullgraph=True)
    compiled(torch.ones(2))
    compiled(-torch.ones(2))


def fake_returns_array():
    import numpy as np

    leaf = leaf_with_fake(lambda x: x + 1, lambda x: np.zeros(2))
    torch.compile(lambda x: leaf(x), backend="eager", fullgraph=True)(torch.ones(2))


def backward_inside_leaf():
    def trains_inside(x):
        y = (x * 2).sum()
        y.backward()
        return x * 2

    # (An activation: a leaf input of an eager call, such as a parameter, is
    # the caller's own tensor inside the function, and its .grad accumulates
    # as with the plain function: test_autograd.py.)
    x = torch.ones(2, requires_grad=True) * 1
    leaf_with_fake(trains_inside, torch.empty_like)(x)


def module_parameter_replaced():
    def replaces(m, x):
        m.weight = nn.Parameter(torch.zeros_like(m.weight))
        return m(x)

    torchleaf.leaf_function(replaces)(nn.Linear(2, 2), torch.ones(1, 2))


def released_state():
    # A traced call (here make_fx) records torchleaf's backward node, which
    # drops the call's state after the first backward. (Eager calls hit
    # PyTorch's own "backward through the graph a second time" check first;
    # see test_autograd.py.)
    from torch.fx.experimental.proxy_tensor import make_fx

    leaf = leaf_with_fake(lambda x: x.exp(), torch.empty_like)

    def grads_twice(x):
        loss = leaf(x).sum()
        first = torch.autograd.grad(loss, x)[0]
        return first + torch.autograd.grad(loss, x)[0]

    make_fx(grads_twice, tracing_mode="fake")(torch.ones(2, requires_grad=True))


def wrong_gradient_count():
    leaf = leaf_with_fake(lambda x: (x * 2, x * 3), lambda x: (torch.empty_like(x), torch.empty_like(x)))
    x = torch.ones(2, requires_grad=True)
    leaf_id, plan = traced_call_site(leaf, x.detach())
    outs, state = torch.ops.torchleaf.forward(leaf_id, plan, [x.detach()], [0])
    try:
        torch.ops.torchleaf.backward(leaf_id, state, [torch.ones(2)], [6, 0, -1, 1, 2])
    except LeafFunctionError as e:
        error = e.with_traceback(None)  # the traceback's frames hold the state handle
    del outs, state
    raise error


def opaque_pytree_context():
    # A pytree node whose context is an arbitrary object cannot be a graph constant.
    class Box:
        def __init__(self, x, meta):
            self.x, self.meta = x, meta

    torch.utils._pytree.register_pytree_node(Box, lambda b: ([b.x], b.meta), lambda xs, meta: Box(xs[0], meta))
    try:
        leaf = leaf_with_fake(lambda box: box.x * 2, lambda box: torch.empty_like(box.x))
        torch.compile(lambda b: leaf(b), backend="eager", fullgraph=True)(Box(torch.ones(2), object()))
    finally:
        torch.utils._pytree._deregister_pytree_node(Box)


def read_and_mutated():
    def bump(x, buf):
        buf.add_(1)
        return x * 2

    leaf = torchleaf.leaf_function(mutates_args={"buf"})(bump)
    t = torch.zeros(2)
    leaf(t, t)


def jit_traced():
    leaf = leaf_with_fake(lambda x: x * 2, torch.empty_like)
    torch.jit.trace(lambda x: leaf(x) + 1, (torch.ones(2),))


def fake_reads_a_float():
    leaf = leaf_with_fake(
        lambda x, capacity: x[: int(x.shape[0] * capacity)],
        lambda x, capacity: x.new_empty(int(x.shape[0] * capacity)),
    )
    torch.compile(lambda x, c: leaf(x, c), backend="eager", fullgraph=True)(torch.ones(8), 0.5)


def unknown_static_argnames():
    torchleaf.leaf_function(static_argnames=("cap",))(lambda x, capacity: x * capacity)


def modules_indistinguishable():
    import copy

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.scale = 1.0

        def forward(self, x):
            return self.lin(x) * self.scale

    leaf = leaf_with_fake(lambda m, x: m(x), lambda m, x: torch.empty_like(x))
    original = Scaled()
    twin = copy.copy(original)
    twin.scale = 2.0
    torch.compile(lambda m, x: leaf(m, x), backend="eager", fullgraph=True)(twin, torch.ones(1, 2))


CASES = [
    (no_fake, LeafFunctionError, r"requires a fake implementation.*register_fake"),
    (fake_structure, LeafFunctionError, r"different output structure than its fake implementation"),
    (fake_shape, LeafFunctionError, r"output 0 has shape \[3\] but its fake implementation gives shape \[2, 3\]"),
    (fake_dtype, LeafFunctionError, r"output 0 has dtype Long but its fake implementation gives dtype Float"),
    (fake_device, LeafFunctionError, r"output 0 is on device cpu but its fake implementation puts it on meta"),
    (fake_wrong_in_compiled_graph, LeafFunctionError, r"output 0 has 1-d shape \[3\] but the fake implementation "
     r"returned 2-d shape \[2, 3\] when the graph was traced\. .*Fix the fake implementation"),
    (undeclared_mutation, LeafFunctionError, r"mutated its input 0 \(argument 'x'\) in place without declaring it"),
    (input_made_to_require_grad, LeafFunctionError, r"called requires_grad_\(\) on its input 1 \(argument 'w'\) inside the function\. .*make the argument require grad before calling the leaf"),
    (input_made_to_require_grad_no_grad_inputs, LeafFunctionError, r"called requires_grad_\(\) on its input 1 \(argument 'w'\)"),
    (multi_grad_hook, LeafFunctionError, r"cannot take a multi-grad hook: register_multi_grad_hook .* is not supported"),
    (unknown_mutates_args, LeafFunctionError, r"mutates_args=\['buffer'\], which is not a parameter"),
    (escaped_gradients, LeafFunctionError, r"uses 1 tensor\(s\) that require grad but are not among its inputs"),
    (real_returns_non_tensor_for_traced_call, LeafFunctionError, r"returned a different output structure"),
    (fake_returns_array, LeafFunctionError, r"returned a ndarray where a tensor or a plain constant"),
    (backward_inside_leaf, LeafFunctionError, r"ran .backward\(\) through its own inputs .* torch.autograd.grad"),
    (module_parameter_replaced, LeafFunctionError, r"replaced 'weight' of its Linear argument"),
    (released_state, LeafFunctionError, r"cannot run backward: its autograd state was already released by an earlier backward\. Pass retain_graph=True"),
    (wrong_gradient_count, LeafFunctionError, r"backward received 1 gradient\(s\) for 2 output\(s\)"),
    (opaque_pytree_context, LeafFunctionError, r"got a Box in positional argument 0 under torch.compile, a pytree node whose context .* is not made of plain constants"),
    (jit_traced, LeafFunctionError, r"was called under torch.jit.trace, which cannot record a leaf function.*Use torch.compile"),
    (fake_reads_a_float, LeafFunctionError, r"read the value of float argument 'capacity'.*static_argnames=\('capacity',\)"),
    (unknown_static_argnames, LeafFunctionError, r"static_argnames=\['cap'\], which is not a parameter"),
    (modules_indistinguishable, LeafFunctionError, r"2 live modules share the tensors of this call, differing in 'scale'.*copy\.deepcopy"),
    (read_and_mutated, LeafFunctionError, r"got the same tensor \(or views of one tensor\) as argument 'x', which it reads, and as argument 'buf', which it mutates in place \(mutates_args\)\. Pass a clone"),
]


# Errors raised while Dynamo runs a fake reach the user wrapped by Dynamo;
# torchleaf's error is at the root of the wrapper's __cause__ chain.
DYNAMO_WRAPPED = {
    fake_returns_array: torch._dynamo.exc.TorchRuntimeError,
    fake_reads_a_float: torch._dynamo.exc.TorchRuntimeError,
    opaque_pytree_context: torch._dynamo.exc.InternalTorchDynamoError,
}


@pytest.mark.parametrize("case,error,pattern", CASES, ids=[c[0].__name__ for c in CASES])
def test_misuse_is_explained(case, error, pattern):
    raised = DYNAMO_WRAPPED.get(case, error)
    # Every message names the leaf: the case's function or a lambda in it.
    leaf_name = rf"leaf function 'test_errors\.{case.__name__}\.<locals>\.[\w<>]+'"
    with pytest.raises(raised, match=leaf_name) as info:
        case()
    exc = info.value
    if raised is not error:
        while exc.__cause__ or exc.__context__:
            exc = exc.__cause__ or exc.__context__
    assert type(exc) is error, repr(info.value)
    message = str(exc)
    assert re.search(pattern, message, re.S), message
    assert re.search(leaf_name, message), message
    torch._dynamo.reset()
    still_usable()


def test_errors_table_lists_every_case():
    import pathlib

    table = (pathlib.Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    for case, _, _ in CASES:
        assert f"`{case.__name__}`" in table, f"docs/errors.md misses {case.__name__}"


@pytest.mark.slow
def test_exceptions_in_fake_and_backward_keep_their_type():
    class FakeBroke(KeyError):
        pass

    def bad_fake(x):
        raise FakeBroke("no shapes today")

    leaf = leaf_with_fake(lambda x: x + 1, bad_fake)
    with pytest.raises(FakeBroke, match="no shapes today") as info:
        with FakeTensorMode():
            leaf(torch.empty(2))
    assert any("fake implementation of leaf function" in n for n in info.value.__notes__)
    # Under torch.compile Dynamo reports it on the operator call, with its
    # context suppressed: the message must name the leaf itself.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: leaf(x) * 2, backend="eager", fullgraph=True)
    with pytest.raises(
        torch._dynamo.exc.TorchRuntimeError,
        match=r"fake implementation of leaf function '.*' raised FakeBroke: 'no shapes today'",
    ):
        compiled(torch.ones(2))
    # A TypeError about arguments is Dynamo's cue for a graph break (the call
    # then runs eagerly, without the fake): left as it is.
    def mistyped_fake(x):
        return x.expand(2, bogus=1)

    mistyped = leaf_with_fake(lambda x: x + 1, mistyped_fake)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: mistyped(x) * 2, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 4.0))

    class BackwardBroke(ArithmeticError):
        pass

    class Fragile(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise BackwardBroke("cannot differentiate")

    fragile = leaf_with_fake(lambda x: Fragile.apply(x), torch.empty_like)
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(BackwardBroke, match="cannot differentiate"):
        fragile(x).sum().backward()
    assert torchleaf.live_states() == 0
    # A compiled call's backward replays the captured graph in torchleaf's
    # backward operator, which names the leaf. (Eagerly the function's own
    # backward nodes run, with no torchleaf code between them.)
    for backend in ("aot_eager", "inductor"):
        compiled = torch.compile(lambda x: fragile(x), backend=backend, fullgraph=True)
        with pytest.raises(BackwardBroke, match="cannot differentiate") as info:
            compiled(x).sum().backward()
        notes = info.value.__notes__
        del info  # its traceback's frames hold the call's state
        gc.collect()
        assert any("raised inside the backward of leaf function 'test_errors." in n for n in notes), notes
        assert torchleaf.live_states() == 0
    # So does torch.func's (a nested engine run, which leaves Python's error
    # indicator set: the note was dropped silently).
    for transform in (
        lambda: torch.func.grad(lambda x: fragile(x).sum())(x.detach()),
        lambda: torch.func.vjp(fragile, x.detach())[1](torch.ones(2)),
    ):
        with pytest.raises(BackwardBroke, match="cannot differentiate") as info:
            transform()
        notes = info.value.__notes__
        del info
        gc.collect()
        assert any("raised inside the backward of leaf function 'test_errors." in n for n in notes), notes
        assert torchleaf.live_states() == 0
    still_usable()


def test_a_mutable_argument_that_requires_grad_is_named_by_its_place():
    """The message gave the tensor's index among the mutable ones as "mutable
    input 0" for the third argument."""

    @torchleaf.leaf_function(mutates_args={"buf"})
    def step(x, y, buf):
        buf.add_(1)
        return x + y

    x = torch.ones(3)
    with pytest.raises(LeafFunctionError, match=r"received tensor 0 of its mutates_args arguments but it requires grad"):
        step(x, x, torch.zeros(3, requires_grad=True))
    assert torchleaf.live_states() == 0
