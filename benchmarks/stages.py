"""Where a compiled leaf call's microseconds go: the operators a compiled
graph runs, timed alone, against the whole compiled fwd+bwd step.

    python benchmarks/stages.py          # prints a markdown table

Small body `x * 2 + 1` on 64 floats, one intra-op thread, interleaved timing
(median of batch means). Each stage is timed by calling exactly what the
compiled graph calls (`torch.ops.torchleaf.forward.default(...)` etc.), so
the rows add up to the operator part of the step; the rest is PyTorch's
runtime around the graph (AOTAutograd wrappers, Dynamo guards, the autograd
engine), which plain code and custom_op pay too.
"""

import os
import sys
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchleaf  # noqa: E402
from timing import time_interleaved  # noqa: E402
from torchleaf import _runner  # noqa: E402


def body(x):
    return x * 2 + 1


def leaf_and_custom_op(namespace):
    """The body as a leaf and as a torch.library.custom_op (in ``namespace``)
    with a hand-written backward."""
    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(torch.empty_like)

    @torch.library.custom_op(f"{namespace}::body", mutates_args=())
    def custom(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    custom.register_fake(torch.empty_like)
    custom.register_autograd(lambda ctx, g: g * 2)
    return leaf, custom


def main():
    torch.set_num_threads(1)
    leaf, custom = leaf_and_custom_op("torchleaf_stages")

    x = torch.randn(64, requires_grad=True)
    steps = {}
    for backend in ("aot_eager", "inductor"):
        for name, fn in (("plain", body), ("custom_op", custom), ("torchleaf", leaf)):
            compiled = torch.compile(lambda x, fn=fn: fn(x).sum(), backend=backend, fullgraph=True)
            compiled(x).backward()
            steps[f"{backend} fwd+bwd: {name}"] = lambda c=compiled: c(x).backward()

    # What the compiled graphs call (see the graphs with TORCH_LOGS=aot_graphs;
    # a graph's first leaf call takes no order token).
    plan = next(p.index for p in leaf._plans.by_index.values() if p.ordered)
    xd, grad = x.detach(), torch.ones(64)
    forward = torch.ops.torchleaf.forward.default
    backward = torch.ops.torchleaf.backward.default
    custom_op = torch.ops.torchleaf_stages.body.default
    _, handle = forward(leaf._id, plan, [xd], [0])
    ref = weakref.ref(leaf)
    steps.update({
        "custom_op's operator (its whole forward, as its graph calls it)": lambda: custom_op(xd),
        "torchleaf.forward (whole operator)": lambda: forward(leaf._id, plan, [xd], [0]),
        "  of which the Python runner (_run_real)": lambda: _runner.run_real(ref, plan, [xd], None),
        "    of which the body": lambda: body(xd),
        "torchleaf.backward (whole operator)": lambda: backward(leaf._id, handle, [grad, None], [6, 0, -1, 1, 64]),
        "  of which `grad * 2` (what the body's backward computes)": lambda: grad * 2,
    })
    timings = time_interleaved(steps, batch=200, rounds=41)
    print("| stage | µs per call |\n|---|---:|")
    for name, t in timings.items():
        print(f"| {name} | {t.median_us:.1f} |")


if __name__ == "__main__":
    main()
