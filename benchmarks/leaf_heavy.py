"""Per-step time of a leaf-heavy model: N layers, each calling one leaf with
its own submodule, as a model that routes every layer through a leaf does.

    python benchmarks/leaf_heavy.py                 # the table (N = 10 and 100)
    python benchmarks/leaf_heavy.py --quick         # few repetitions
    python benchmarks/leaf_heavy.py --cold-compile  # cold Inductor compile, N = 100
    python benchmarks/leaf_heavy.py --split         # forward/backward/SGD by part, N = 100

Each layer is ``Block`` (Linear(16, 16), LayerNorm, ReLU, a residual); a step
is forward, backward and an SGD update on x: 8x16 float32. The layer's
function runs inline (plain), as a torchleaf leaf taking the block, as
PyTorch's built-in leaf_function, or behind a graph break
(torch.compiler.disable); the model runs eagerly or compiled with aot_eager
or inductor. Figures are per step, timed interleaved in one process
(timing.py), with each variant's ratio to plain code in the same mode.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import types

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchleaf  # noqa: E402
from timing import time_interleaved  # noqa: E402

WIDTH = 16
DESCRIPTION = (
    f"N layers, each calling one leaf with its own block (Linear({WIDTH}, {WIDTH}), LayerNorm, ReLU, "
    f"residual); fwd + bwd + SGD on x: 8x{WIDTH} float32"
)
MODES = ("eager", "aot_eager", "inductor")
IMPLEMENTATIONS = ("plain", "torchleaf", "builtin_leaf", "graph_break")
LABELS = {
    "plain": "plain (inline)",
    "torchleaf": "torchleaf",
    "builtin_leaf": "built-in leaf_function",
    "graph_break": "graph break",
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)


def layer(block, x):
    return block.norm(block.lin(x)).relu() + x


def _fake(block, x):
    return torch.empty_like(x)


def _functions():
    leaf = torchleaf.leaf_function(layer)
    leaf.register_fake(_fake)
    from torch._dynamo.decorators import leaf_function as builtin

    def builtin_layer(block, x):  # (a function of its own: the decorator marks it)
        return layer(block, x)

    builtin_leaf = builtin(builtin_layer)
    builtin_leaf.register_fake(_fake)
    return {
        "plain": layer,
        "torchleaf": leaf,
        "builtin_leaf": builtin_leaf,
        "graph_break": torch.compiler.disable(layer),
    }


class Model(nn.Module):
    def __init__(self, n, fn):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.fn = fn

    def forward(self, x):
        for block in self.blocks:
            x = self.fn(block, x)
        return x


def _model_class(impl):
    """Model with a forward of its own code object: Dynamo caches compiled
    frames per code object and checks each entry's guards in turn (for a
    100-layer model, thousands), so variants sharing one forward would each
    pay for checking the others' guards first."""
    forward = Model.forward
    code = forward.__code__.replace(co_name=f"forward_{impl}")
    own = types.FunctionType(code, forward.__globals__, f"forward_{impl}", forward.__defaults__, forward.__closure__)
    return type(f"Model_{impl}", (Model,), {"forward": own})


def make_step(n, impl, mode, fns=None, seed=0):
    """(step, model): one training step of a fresh model."""
    fns = fns or _functions()
    torch.manual_seed(seed)
    model = _model_class(impl)(n, fns[impl])
    x = torch.randn(8, WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    forward = model if mode == "eager" else torch.compile(model, backend=mode)

    def step():
        opt.zero_grad(set_to_none=True)
        forward(x).square().mean().backward()
        opt.step()

    return step, model


def run(quick=False, sizes=(10, 100), log=print):
    """{(n, mode, impl): Timing or the error text}"""
    fns = _functions()
    results = {}
    for n in sizes:
        for mode in MODES:
            log(f"  leaf-heavy N={n} / {mode}")
            steps = {}
            torch._dynamo.reset()  # (once per mode: a reset recompiles every variant)
            for impl in IMPLEMENTATIONS:
                try:
                    step, _ = make_step(n, impl, mode, fns)
                    for _ in range(3):  # (compiles, and recompiles once the grads exist)
                        step()
                    steps[impl] = step
                except Exception as e:  # a variant that cannot run is reported, not fatal
                    results[(n, mode, impl)] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            batch, rounds = (2, 3) if quick else ((20, 15) if n <= 10 else (5, 15))
            while steps:
                failed = []

                def guarded(impl, step):
                    def run_step():
                        try:
                            step()
                        except Exception as e:
                            failed.append(impl)
                            results[(n, mode, impl)] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                            raise
                    return run_step

                try:
                    timings = time_interleaved(
                        {impl: guarded(impl, step) for impl, step in steps.items()}, batch=batch, rounds=rounds
                    )
                except Exception:
                    if not failed:
                        raise
                    del steps[failed[0]]  # (a variant that fails on a later step: the others again)
                    continue
                for impl, timing in timings.items():
                    results[(n, mode, impl)] = timing
                break
    return results


def table(results, sizes=(10, 100)):
    lines = [
        "| N | mode | " + " | ".join(LABELS[i] for i in IMPLEMENTATIONS) + " |",
        "|---:|---|" + "---:|" * len(IMPLEMENTATIONS),
    ]
    for n in sizes:
        for mode in MODES:
            plain = results.get((n, mode, "plain"))
            cells = []
            for impl in IMPLEMENTATIONS:
                r = results.get((n, mode, impl))
                if r is None:
                    cells.append("—")
                elif isinstance(r, str):
                    cells.append(f"fails: {r.split(':')[0]}")
                else:
                    ms = r.median_us / 1000
                    ratio = "" if impl == "plain" or not hasattr(plain, "median_us") else f" ({r.median_us / plain.median_us:.2f}×)"
                    cells.append(f"{ms:.2f} ms{ratio}")
            lines.append(f"| {n} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cold_compile_child(impl, n):
    """Runs in a fresh process with an empty Inductor cache: seconds to the
    end of the first compiled training step."""
    step, _ = make_step(n, impl, "inductor")
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def cold_compile(n=100, log=print):
    """{impl: seconds} for plain and torchleaf, each in a fresh process with
    a fresh Inductor cache directory."""
    out = {}
    for impl in ("plain", "torchleaf"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0")
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--cold-child", impl, str(n)],
                capture_output=True, text=True, env=env,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"cold compile of {impl} failed:\n{proc.stderr[-3000:]}")
            out[impl] = float(proc.stdout.strip().splitlines()[-1])
            n_kernels = sum(len(files) for _, _, files in os.walk(cache))
            log(f"  cold inductor compile, N={n}, {impl}: {out[impl]:.1f} s ({n_kernels} files in the cache)")
    return out


SPLIT_VARIANTS = (("plain", "eager"), ("plain", "inductor"), ("torchleaf", "aot_eager"), ("torchleaf", "inductor"))


def split(n=100, rounds=40):
    """{(impl, mode): {"forward", "forward ops", "backward", "backward ops",
    "sgd"}: ms per step}, one thread, the variants interleaved in one
    process; torchleaf's forward and backward operators are timed by wrapping
    them after compilation (docs/profile.md, "A leaf-heavy model")."""
    torch.set_num_threads(1)
    fns = _functions()
    clock = time.perf_counter
    sums: dict = {}
    current: list = [None]
    steps = {}
    for impl, mode in SPLIT_VARIANTS:
        torch.manual_seed(0)
        model = _model_class(f"{impl}_{mode}")(n, fns[impl])
        x = torch.randn(8, WIDTH)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        forward = model if mode == "eager" else torch.compile(model, backend=mode)

        def step(forward=forward, opt=opt, x=x, key=(impl, mode)):
            current[0] = sums[key]
            opt.zero_grad(set_to_none=True)
            t0 = clock()
            loss = forward(x).square().mean()
            t1 = clock()
            loss.backward()
            t2 = clock()
            opt.step()
            t3 = clock()
            for part, t in (("forward", t1 - t0), ("backward", t2 - t1), ("sgd", t3 - t2)):
                current[0][part] += t

        sums[(impl, mode)] = dict.fromkeys(("forward", "forward ops", "backward", "backward ops", "sgd"), 0.0)
        for _ in range(5):  # (compiles, and recompiles once the grads exist)
            step()
        steps[(impl, mode)] = step
    # Wrapped only now: Dynamo would trace the wrappers.
    wrapped = []
    for name, part in (("forward", "forward ops"), ("backward", "backward ops")):
        packet = getattr(torch.ops.torchleaf, name)
        real = packet.default

        def timed(*args, real=real, part=part):
            start = clock()
            try:
                return real(*args)
            finally:
                current[0][part] += clock() - start

        packet.default = timed
        wrapped.append((packet, real))
    try:
        for totals in sums.values():
            totals.update(dict.fromkeys(totals, 0.0))
        for _ in range(rounds):
            for step in steps.values():
                step()
    finally:
        for packet, real in wrapped:
            packet.default = real
    return {key: {part: t / rounds * 1e3 for part, t in totals.items()} for key, totals in sums.items()}


def split_table(results):
    lines = [
        "| | forward | of which torchleaf operators | backward | of which torchleaf operators | SGD |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (impl, mode), ms in results.items():
        ops = (f"{ms['forward ops']:.2f}", f"{ms['backward ops']:.2f}") if impl == "torchleaf" else ("—", "—")
        lines.append(
            f"| {impl}, {mode} | {ms['forward']:.2f} | {ops[0]} | {ms['backward']:.2f} | {ops[1]} | {ms['sgd']:.2f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cold-compile", action="store_true")
    parser.add_argument("--cold-child", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="10,100")
    parser.add_argument("--split", action="store_true", help="ms per step by part, N = 100, one thread")
    args = parser.parse_args()
    if args.split:
        print(split_table(split()))
        return
    if args.cold_child:
        print(_cold_compile_child(args.cold_child[0], int(args.cold_child[1])))
        return
    if args.cold_compile:
        times = cold_compile()
        print(f"torchleaf / plain: {times['torchleaf'] / times['plain']:.2f}×")
        return
    sizes = tuple(int(s) for s in args.sizes.split(","))
    results = run(quick=args.quick, sizes=sizes)
    print(DESCRIPTION)
    print(table(results, sizes))


if __name__ == "__main__":
    main()
