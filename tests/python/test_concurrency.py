"""4 threads x 1,000 forward+backward calls of one leaf, eagerly and through
a compiled program: results checked, no deadlock, no state left behind."""

import threading

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

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker did not finish"
    assert not errors, errors[0]
    assert torchleaf.live_states() == 0


def test_threads_eager():
    _hammer(_leaf())


def test_threads_compiled():
    leaf = _leaf()
    compiled = torch.compile(lambda x, w: leaf(x, w) + 0, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(16), torch.randn(16, requires_grad=True))  # compile once, up front
    _hammer(compiled)
