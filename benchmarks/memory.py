"""Memory benchmarks, each run in a fresh subprocess (``python memory.py ...``).

CPU PyTorch keeps no allocator statistics, so memory is read from the
kernel: the resident high-water mark (VmHWM in /proc/self/status) and the
current resident size (/proc/self/statm).

``peak VARIANT``: three training steps (grads set to None, forward,
  backward) of a medium body with large saved
  activations (1024x1024 float32 tensors, two matmuls), undecorated
  ("plain"), through a torchleaf leaf, or as a hand-written
  autograd.Function (a control). Reports the high-water mark before
  and after, so the increment is what forward+backward itself added.
``growth VARIANT CALLS``: resident size and torchleaf.live_states() before
  and after CALLS forward+backward calls of the small body.

Each prints one JSON object on its last line of stdout.
"""

import gc
import json
import os
import sys

import torch

import torchleaf

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024


def vm_hwm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_hwm():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_body(x, w1, w2):
    h = torch.tanh(x @ w1)
    return torch.relu(h @ w2)


class MemBodyFunction(torch.autograd.Function):
    """mem_body with its backward written by hand (a control: one backward
    node that returns all input gradients at once, like a leaf)."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        h = torch.tanh(x @ w1)
        out = torch.relu(h @ w2)
        ctx.save_for_backward(x, w1, w2, h, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w1, w2, h, out = ctx.saved_tensors
        g2 = grad * (out > 0)
        gh = g2 @ w2.mT
        gw2 = h.mT @ g2
        del g2
        g1 = gh * (1 - h * h)
        del gh
        return g1 @ w1.mT, x.mT @ g1, gw2


def small_body(x):
    return x * 2 + 1


def _leaf(fn, fake):
    leaf = torchleaf.leaf_function(fn)
    leaf.register_fake(fake)
    return leaf


def variant(name, fn, fake):
    if name == "plain":
        return fn
    if name == "torchleaf":
        return _leaf(fn, fake)
    if name == "autograd_function" and fn is mem_body:
        return MemBodyFunction.apply
    raise SystemExit(f"unknown variant {name!r}")


def peak(name, size=1024):
    fn = variant(name, mem_body, lambda x, w1, w2: x.new_empty(x.shape[0], w2.shape[1]))
    torch.manual_seed(0)

    def inputs(n):
        return [torch.randn(n, n, requires_grad=True) for _ in range(3)]

    # One-time costs (operator registration, autograd engine) on tiny tensors.
    fn(*inputs(8)).sum().backward()
    x, w1, w2 = inputs(size)
    gc.collect()
    hwm_was_reset = reset_hwm()
    rss_before = rss_bytes()
    hwm_before = vm_hwm_bytes()
    for _ in range(3):  # a training step: grads set to None, forward, backward
        for t in (x, w1, w2):
            t.grad = None
        fn(x, w1, w2).sum().backward()
    hwm_after = vm_hwm_bytes()
    return {
        "variant": name,
        "size": size,
        "rss_before_mib": rss_before / MIB,
        "hwm_before_mib": hwm_before / MIB,
        "hwm_after_mib": hwm_after / MIB,
        "increment_mib": (hwm_after - max(rss_before, hwm_before if hwm_was_reset else rss_before)) / MIB,
        "hwm_was_reset": hwm_was_reset,
        "live_states_after": torchleaf.live_states(),
    }


def growth(name, calls):
    fn = variant(name, small_body, lambda x: torch.empty_like(x))
    x = torch.randn(64, requires_grad=True)
    for _ in range(1000):  # warm-up: caches, registration, allocator pools
        fn(x).sum().backward()
    gc.collect()
    rss_before, states_before = rss_bytes(), torchleaf.live_states()
    for _ in range(calls):
        fn(x).sum().backward()
    gc.collect()
    rss_after, states_after = rss_bytes(), torchleaf.live_states()
    return {
        "variant": name,
        "calls": calls,
        "rss_before_mib": rss_before / MIB,
        "rss_after_mib": rss_after / MIB,
        "growth_mib": (rss_after - rss_before) / MIB,
        "live_states_before": states_before,
        "live_states_after": states_after,
    }


def main(argv):
    kind, name, *rest = argv
    torch.set_num_threads(1)
    if kind == "peak":
        result = peak(name)
    elif kind == "growth":
        result = growth(name, int(rest[0]))
    else:
        raise SystemExit(f"unknown benchmark {kind!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
