"""Wall-clock time of a compiled fwd+bwd step, forward and backward apart.

    python benchmarks/wall_split.py                      # aot_eager, 3 rounds
    python benchmarks/wall_split.py --backend inductor --rounds 5 --steps 20000

Each variant (inline body, custom_op, leaf; small body ``x * 2 + 1`` on 64
floats, one torch thread) runs in a process of its own, one after another,
round after round, so that no variant shares caches, allocator state or
Dynamo guards with another. A process compiles, warms up, then times each
step's forward (the compiled call) and backward (``.backward()``) with
``time.perf_counter_ns``, garbage collector off. Prints a markdown table of
the per-round means (µs per step); rounds show the machine's noise.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("plain", "custom_op", "torchleaf")


def _child(variant, backend, steps):
    import gc
    import time

    import torch

    sys.path.insert(0, HERE)
    from stages import body, leaf_and_custom_op

    torch.set_num_threads(1)
    leaf, custom = leaf_and_custom_op("torchleaf_wall_split")
    fn = {"plain": body, "custom_op": custom, "torchleaf": leaf}[variant]
    x = torch.randn(64, requires_grad=True)
    compiled = torch.compile(lambda x: fn(x).sum(), backend=backend, fullgraph=True)
    for _ in range(500):
        compiled(x).backward()
    gc.collect()
    gc.disable()
    clock = time.perf_counter_ns
    forward = backward = 0
    for _ in range(steps):
        t0 = clock()
        loss = compiled(x)
        t1 = clock()
        loss.backward()
        t2 = clock()
        forward += t1 - t0
        backward += t2 - t1
    print(f"{forward / steps / 1e3:.2f} {backward / steps / 1e3:.2f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        return _child(args.child, args.backend, args.steps)
    print(f"compile({args.backend}), µs per step ({args.steps} steps per process)\n")
    print("| round | " + " | ".join(f"{v} fwd | {v} bwd | {v} step" for v in VARIANTS) + " |")
    print("|---:|" + "---:|" * (3 * len(VARIANTS)))
    for r in range(args.rounds):
        cells = []
        for variant in VARIANTS:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", variant, "--backend", args.backend,
                 "--steps", str(args.steps)],
                capture_output=True, text=True, check=True,
            ).stdout.split()
            fwd, bwd = float(out[-2]), float(out[-1])
            cells += [f"{fwd:.1f}", f"{bwd:.1f}", f"{fwd + bwd:.1f}"]
        print(f"| {r + 1} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
