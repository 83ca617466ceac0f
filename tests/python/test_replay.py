"""C++ leaves through every operator path from Python: a leaf that declares
its arity (LeafOptions::inputs) refuses another count with a clear error on
each path, and traced calls, whose backward replays the captured graph,
give eager's gradients. (The replay itself is compared with the autograd
engine in tests/cpp/test_replay.cpp.)"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torchleaf
from torchleaf import LeafFunctionError

_WRONG_COUNT = r"leaf function 'torchleaf_test::checked_add' takes 2 input tensor\(s\) \(LeafOptions::inputs\) but was called with {}"


def _cause_chain(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def test_a_declared_arity_is_checked_on_every_path(cpp_leaves):
    ops, _ = cpp_leaves
    x = torch.randn(3)
    g = torch.randn(3, requires_grad=True)
    for args, count in (([x], 1), ([x, x, x], 3), ([], 0), ([g], 1)):
        with pytest.raises(LeafFunctionError, match=_WRONG_COUNT.format(count)):
            ops.checked_add(args)
    with FakeTensorMode(), pytest.raises(LeafFunctionError, match=_WRONG_COUNT.format(1)):
        ops.checked_add([torch.empty(3)])
    with pytest.raises(LeafFunctionError, match=_WRONG_COUNT.format(1)):
        ops.checked_add([torch.empty(3, device="meta")])
    with pytest.raises(LeafFunctionError, match=_WRONG_COUNT.format(1)):
        make_fx(lambda a: ops.checked_add([a]))(x)
    with pytest.raises(Exception) as info:
        torch.compile(lambda a: ops.checked_add([a]), backend="aot_eager", fullgraph=True)(g)
    assert any(isinstance(e, LeafFunctionError) for e in _cause_chain(info.value)), info.value
    assert "takes 2 input tensor(s)" in str(info.value)

    # The process is fine: the right count works on every path.
    torch.testing.assert_close(ops.checked_add([x, g])[0], x + g)
    compiled = torch.compile(lambda a, b: ops.checked_add([a, b])[0], backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, g), x + g)
    assert torchleaf.live_states() == 0


@torchleaf.leaf_function
def _sin3(x):
    return (x * 3).sin()


@torchleaf.leaf_function
def _add(a, b):
    return a + b


_sin3.register_fake(torch.empty_like)
_add.register_fake(lambda a, b: torch.empty_like(a))


@pytest.mark.parametrize("kind", ["cpp", "python"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_traced_calls_replay_to_eager_gradients(cpp_leaves, backend, kind):
    """A compiled graph's backward replays each leaf call's captured graph:
    one leaf output feeds two calls, and a + b's backward hands the same
    gradient tensor to both inputs (Inductor, which reuses dead buffers in
    place, corrupted the second one while torchleaf::backward returned
    aliases)."""
    ops, _ = cpp_leaves
    if kind == "cpp":
        sin3, add = (lambda x: ops.sin3([x])[0]), (lambda a, b: ops.checked_add([a, b])[0])
    else:
        sin3, add = _sin3, _add

    def fn(x, y):
        s = sin3(x)
        a = add(s, y * 2)
        b = add(a, s)
        return (a * b).sum() + b.exp().mean() + (add(x.sin(), y) ** 2).sum()

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(fn(x, y), (x, y))
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    got = torch.autograd.grad(compiled(x, y), (x, y))
    torch.testing.assert_close(got, expected)
