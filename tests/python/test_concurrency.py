"""4 threads x 1,000 forward+backward calls of one leaf, eagerly and through
a compiled program: results checked, no deadlock, no state left behind. And
threads sharing one module argument, whose tensors a call swaps for its own
while its function runs."""

import threading

import pytest
import torch

import torchleaf

THREADS = 4
CALLS = 1000


def _leaf():
    @torchleaf.leaf_function
    def scaled_tanh(x, w):
        return torch.tanh(x * w) * 2

    @scaled_tanh.register_fake
    def _(x, w):
        return torch.empty_like(x)

    return scaled_tanh


def _hammer(fn):
    errors = []
    barrier = threading.Barrier(THREADS)

    def worker(seed):
        try:
            gen = torch.Generator().manual_seed(seed)
            barrier.wait()
            for _ in range(CALLS):
                x = torch.randn(16, generator=gen)
                w = torch.randn(16, generator=gen).requires_grad_()
                out = fn(x, w)
                (gw,) = torch.autograd.grad(out.sum(), w)
                expected = torch.tanh(x * w.detach()) * 2
                torch.testing.assert_close(out.detach(), expected)
                torch.testing.assert_close(gw, 2 * x * (1 - torch.tanh(x * w.detach()) ** 2))
        except BaseException as e:  # reported below, with the thread's seed
            errors.append((seed, e))

    _run_threads(worker, range(THREADS), errors)
    assert torchleaf.live_states() == 0


def _run_threads(worker, args, errors):
    """Runs worker(arg) on a thread per arg; fails on a hang or an error."""
    threads = [threading.Thread(target=worker, args=(arg,)) for arg in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker did not finish"
    assert not errors, errors[0]


@pytest.mark.slow
def test_threads_eager():
    _hammer(_leaf())


@pytest.mark.slow
def test_threads_compiled():
    leaf = _leaf()
    compiled = torch.compile(lambda x, w: leaf(x, w) + 0, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(16), torch.randn(16, requires_grad=True))  # compile once, up front
    _hammer(compiled)


def test_eager_calls_while_another_thread_compiles():
    """torch.compiler.is_compiling() is process-wide in torch 2.13: while one
    thread compiles, eager leaf calls in others (a nested one included) must
    still run eagerly. The compiling thread's backend holds the compile open
    until the eager calls are done."""
    leaf = _leaf()

    @torchleaf.leaf_function
    def outer(x, w):
        return leaf(x, w) + 1

    outer.register_fake(lambda x, w: torch.empty_like(x))
    compiling, eager_done, errors = threading.Event(), threading.Event(), []

    def waiting_backend(gm, example_inputs):
        compiling.set()
        assert eager_done.wait(timeout=120), "the eager thread did not finish"
        return gm

    def compile_something(_):
        try:
            torch.compile(lambda x: x.cos() * 3, backend=waiting_backend)(torch.randn(4))
        except BaseException as e:
            errors.append(e)

    def call_eagerly(_):
        try:
            assert compiling.wait(timeout=120)
            assert torch.compiler.is_compiling()  # what made these calls fail
            x, w = torch.randn(16), torch.randn(16, requires_grad=True)
            for fn, extra in ((leaf, 0), (outer, 1)):
                out = fn(x, w)
                (gw,) = torch.autograd.grad(out.sum(), w)
                torch.testing.assert_close(out.detach(), torch.tanh(x * w.detach()) * 2 + extra)
                torch.testing.assert_close(gw, 2 * x * (1 - torch.tanh(x * w.detach()) ** 2))
        except BaseException as e:
            errors.append(e)
        finally:
            eager_done.set()

    threads = [threading.Thread(target=compile_something, args=(0,)), threading.Thread(target=call_eagerly, args=(0,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert torchleaf.live_states() == 0


def test_threads_sharing_a_module_argument():
    """Two threads calling a leaf with the same module: a call swaps the
    module's parameters for its own tensors while its function runs. Without
    a lock, a call that started meanwhile took the other call's tensors for
    the module's, raised "replaced 'weight'" and restored them in place of
    the Parameters: the model was left with plain tensors, untrainable."""
    model = torch.nn.Linear(16, 16, dtype=torch.float64)
    weight = model.weight
    leaf = torchleaf.leaf_function(lambda x, m: m(x).tanh())
    inputs = [torch.randn(4, 16, dtype=torch.float64) for _ in range(2)]
    calls = 300
    errors = []
    barrier = threading.Barrier(2)

    def worker(x):
        try:
            barrier.wait()
            for k in range(calls):
                if k % 2:
                    with torch.no_grad():
                        torch.testing.assert_close(leaf(x, model), model(x).tanh())
                else:
                    leaf(x, model).sum().backward()
        except BaseException as e:
            errors.append(e)

    _run_threads(worker, inputs, errors)
    assert model.weight is weight and type(model.weight) is torch.nn.Parameter
    expected = torch.zeros_like(weight)
    for x in inputs:
        expected += torch.autograd.grad(model(x).tanh().sum(), weight)[0] * (calls // 2)
    torch.testing.assert_close(weight.grad, expected)
    assert torchleaf.live_states() == 0


def _call_in_child(queue):
    leaf = torchleaf.leaf_function(lambda x, m: m(x))
    queue.put(tuple(leaf(torch.ones(2, 3), torch.nn.Linear(3, 3)).shape))


def test_a_child_forked_during_a_module_call_can_call_leaves():
    """The module-call lock, held by another thread when the process forks (a
    fork DataLoader worker), was inherited held by a thread the child lacks:
    the child's first leaf call with a module waited forever."""
    import multiprocessing

    entered, release = threading.Event(), threading.Event()

    def waits(x, m):
        entered.set()
        release.wait(timeout=60)
        return m(x)

    leaf = torchleaf.leaf_function(waits)
    holder = threading.Thread(target=leaf, args=(torch.ones(2, 3), torch.nn.Linear(3, 3)))
    holder.start()
    try:
        assert entered.wait(timeout=60)
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_call_in_child, args=(queue,))
        child.start()
        child.join(timeout=60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive, "the forked child hung on the module-call lock"
        assert child.exitcode == 0 and queue.get(timeout=10) == (2, 3)
    finally:
        release.set()
        holder.join(timeout=60)
