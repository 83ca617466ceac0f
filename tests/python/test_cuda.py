"""Leaf functions on CUDA tensors: values and gradients against the plain
function, eager and compiled, across streams, offloading, autocast, and CUDA
graphs (torch.compile(mode="reduce-overhead")), where a leaf call must never be
captured: a captured call would replay yesterday's kernels without running the
Python body.

Marked `cuda`; skipped where no GPU is available (CI has none: these run on a
lent GPU machine, `pytest -m cuda`)."""

import pytest
import torch

import torchleaf

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ["eager", "aot_eager", "inductor"]


def _body(x, w):
    y = x @ w
    if y.abs().max() > 1e6:  # data-dependent Python
        y = y / y.abs().max()
    return y.tanh() * 2


def _leaf():
    leaf = torchleaf.leaf_function(_body)
    leaf.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[1]))
    return leaf


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(16, 8, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(8, 4, device="cuda", dtype=dtype, requires_grad=True)
    return x, w


def _values_and_grads(f, x, w):
    x.grad = w.grad = None
    out = f(x, w)
    out.sum().backward()
    return out.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_values_and_gradients_match_the_plain_function(backend):
    leaf = _leaf()
    x, w = _inputs()
    f = leaf if backend is None else torch.compile(lambda x, w: leaf(x, w), backend=backend, fullgraph=True)
    got = _values_and_grads(f, x, w)
    expected = _values_and_grads(_body, x, w)
    for a, b in zip(got, expected):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b)
    assert torchleaf.live_states() == 0


def test_gradcheck_in_float64():
    leaf = _leaf()
    x, w = _inputs(torch.float64)
    assert torch.autograd.gradcheck(leaf, (x, w))


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_backward_on_another_stream(backend):
    """The state a call's handle owns stays valid when backward runs on
    another stream than the forward."""
    leaf = _leaf()
    x, w = _inputs()
    f = leaf if backend is None else torch.compile(lambda x, w: leaf(x, w), backend=backend, fullgraph=True)
    expected = _values_and_grads(_body, x, w)
    x.grad = w.grad = None
    side = torch.cuda.Stream()
    out = f(x, w)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.testing.assert_close(x.grad, expected[1])
    torch.testing.assert_close(w.grad, expected[2])
    del out
    assert torchleaf.live_states() == 0


def test_save_on_cpu_with_pinned_memory():
    leaf = _leaf()
    x, w = _inputs()
    expected = _values_and_grads(_body, x, w)
    x.grad = w.grad = None
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = leaf(x, w)
    out.sum().backward()
    torch.testing.assert_close(x.grad, expected[1])
    torch.testing.assert_close(w.grad, expected[2])


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_autocast_on_cuda(backend):
    leaf = _leaf()
    leaf.register_fake(lambda x, w: x @ w)  # the autocast dtype, as the body's matmul gives
    x, w = _inputs()
    f = leaf if backend is None else torch.compile(lambda x, w: leaf(x, w), backend=backend, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.float16):
        got = f(x, w)
        expected = _body(x, w)
    assert got.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(got, expected)
    got.float().sum().backward()
    assert x.grad is not None and w.grad is not None


def test_cuda_graphs_never_capture_a_leaf_call():
    """Under mode="reduce-overhead" (CUDA graphs) the real function runs on
    every replay: a body whose result follows a Python counter gives each
    call's own value. Inductor keeps the leaf's operators out of CUDA graphs
    (they are tagged cudagraph_unsafe: it splits the graph around them, or
    runs it without CUDA graphs)."""
    calls = []

    @torchleaf.leaf_function
    def counted(x):
        calls.append(1)
        return x * len(calls)

    @counted.register_fake
    def _(x):
        return torch.empty_like(x)

    f = torch.compile(lambda x: counted(x.sin()) + 1, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(32, device="cuda")
    for step in range(1, 6):
        out = f(x)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x.sin() * len(calls) + 1)
        assert len(calls) >= step  # the body ran on this call too
    assert torchleaf.live_states() == 0
