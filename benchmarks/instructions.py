"""Where a compiled leaf call's work goes, counted in CPU instructions.

    python benchmarks/instructions.py            # markdown table on stdout
    python benchmarks/instructions.py --n 100    # fewer calls per stage (faster)

Wall-clock timing on a shared 2-core machine moves by 2x with the load;
instruction counts do not. Each stage runs in its own process under
Valgrind's callgrind with instrumentation switched on only around N calls
(after import, compilation and warm-up), so a row is exactly the
instructions one call of that stage executes (``Ir / N``). Needs valgrind
(``apt-get install valgrind``); runs each stage in ~30-60 s.

Stages (small body ``x * 2 + 1`` on 64 floats, compile(aot_eager) unless
named "inductor"):

- the whole compiled fwd+bwd step for the inline body, custom_op and the
  leaf, under aot_eager and under Inductor;
- the compiled forward without gradients (inference) for custom_op and the
  leaf;
- the eager fwd+bwd step for the inline body and the leaf;
- leaf_heavy.py's training step (N = 10 blocks, fwd + bwd + SGD): the plain
  model run eagerly, the floor of a leaf-heavy model, and the leaf per block
  run eagerly and under Inductor;
- the operators the leaf's compiled graphs call, one level down at a time:
  ``torchleaf.forward`` (called as the FX graph calls it), the Python runner
  it calls, the body with and without autograd recording, and
  ``torchleaf.backward`` (forward+backward operators minus forward).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import weakref

STAGES = (
    ("step: plain", "compiled fwd+bwd of the inline body"),
    ("step: custom_op", "compiled fwd+bwd, torch.library.custom_op"),
    ("step: torchleaf", "compiled fwd+bwd, leaf function"),
    ("inductor step: plain", "compiled(inductor) fwd+bwd of the inline body"),
    ("inductor step: custom_op", "compiled(inductor) fwd+bwd, torch.library.custom_op"),
    ("inductor step: torchleaf", "compiled(inductor) fwd+bwd, leaf function"),
    ("inference step: custom_op", "compiled forward without gradients, torch.library.custom_op"),
    ("inference step: torchleaf", "compiled forward without gradients, leaf function"),
    ("grad forward step: custom_op", "compiled forward recording gradients, outputs dropped, torch.library.custom_op"),
    ("grad forward step: torchleaf", "compiled forward recording gradients, outputs dropped, leaf function"),
    ("eager step: plain", "eager fwd+bwd of the inline body"),
    ("eager step: torchleaf", "eager fwd+bwd, leaf function"),
    ("leaf-heavy step: plain eager", "leaf_heavy.py's training step, N = 10, the plain model run eagerly (a leaf's floor)"),
    ("leaf-heavy step: torchleaf eager", "the same step, a leaf per block, run eagerly"),
    ("leaf-heavy step: torchleaf inductor", "the same step, a leaf per block, compiled with Inductor"),
    ("large module forward: plain", "eager forward of module_args.py's 400-parameter model, inline"),
    ("large module forward: torchleaf", "the same model as a leaf's module argument"),
    ("forward op", "torchleaf.forward as the graph calls it"),
    ("custom_op op", "the custom_op's operator as its graph calls it"),
    ("runner", "the Python runner (_run_real) the forward op calls"),
    ("body recording autograd", "the body on an input that requires grad"),
    ("body", "the body without autograd"),
    ("forward+backward ops", "torchleaf.forward then torchleaf.backward"),
    ("empty loop", "the measuring loop itself"),
)


def _stage_callable(name):
    import torch

    from stages import body, leaf_and_custom_op
    from torchleaf import _runner

    torch.set_num_threads(1)
    leaf, custom = leaf_and_custom_op("torchleaf_profile")
    x = torch.randn(64, requires_grad=True)
    if name.startswith(("inference step: ", "grad forward step: ")):
        # Forward only: the input without grad (inference graph), or with it
        # (the capture runs, the outputs are dropped).
        fn = {"custom_op": custom, "torchleaf": leaf}[name.split("step: ")[1]]
        compiled = torch.compile(lambda x: fn(x).sum(), backend="aot_eager", fullgraph=True)
        given = x.detach() if name.startswith("inference") else x
        return lambda: compiled(given)
    if name.startswith("leaf-heavy step: "):
        import leaf_heavy  # (the leaf-heavy table's model and step)

        # (Not the plain model under Inductor: its kernels die of an illegal
        # instruction under this Valgrind.)
        variant = name[len("leaf-heavy step: "):]
        impl, mode = variant.split(" ")
        step, _ = leaf_heavy.make_step(10, impl, mode)
        return step
    if "step: " in name and not name.startswith("eager"):
        backend = "inductor" if name.startswith("inductor") else "aot_eager"
        fn = {"plain": body, "custom_op": custom, "torchleaf": leaf}[name.split("step: ")[1]]
        compiled = torch.compile(lambda x: fn(x).sum(), backend=backend, fullgraph=True)
        return lambda: compiled(x).backward()
    if name.startswith("large module forward: "):
        import module_args  # (the per-parameter table's model and leaf)

        model, x_small, variants = module_args.model_and_variants()
        fn = variants[name[len("large module forward: "):]]
        return lambda: fn(model, x_small)
    if name.startswith("eager step: "):
        fn = {"plain": body, "torchleaf": leaf}[name[len("eager step: "):]]
        return lambda: fn(x).sum().backward()
    compiled = torch.compile(lambda x: leaf(x).sum(), backend="aot_eager", fullgraph=True)
    compiled(x).backward()
    plan = next(p.index for p in leaf._plans.by_index.values() if p.ordered)
    xd, grad = x.detach(), torch.ones(64)
    forward = torch.ops.torchleaf.forward.default
    backward = torch.ops.torchleaf.backward.default
    ref = weakref.ref(leaf)

    def forward_backward():
        _, handle = forward(leaf._id, plan, [xd], [0])
        backward(leaf._id, handle, [grad, None], [6, 0, -1, 1, 64])

    chosen = {
        "forward op": lambda: forward(leaf._id, plan, [xd], [0]),
        "custom_op op": lambda: torch.ops.torchleaf_profile.body.default(xd),
        "runner": lambda: _runner.run_real(ref, plan, [xd], None),
        "body recording autograd": lambda: body(x),
        "body": lambda: body(xd),
        "forward+backward ops": forward_backward,
        "empty loop": lambda: None,
    }[name]
    chosen.keep_alive = leaf  # the runner stage holds it only weakly
    return chosen


def _child(name, n, ready, done):
    step = _stage_callable(name)
    for _ in range(50):
        step()
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3)  # callgrind_control switches instrumentation on
    for _ in range(n):
        step()
    with open(done, "w") as f:
        f.write("1")
    time.sleep(2)  # ... and off


# Parts of a compiled step found by function in callgrind's inclusive counts:
# PyTorch's own symbols (libtorch keeps them; a stripped torchleaf build
# would not), each (part, pattern of callgrind_annotate's function line).
PARTS = (
    # Inductor's size-and-stride check of a graph input or an extern
    # kernel's output.
    ("size asserts", r"::assert_size_stride\(_object\*, _object\*\) \["),
    # Autograd nodes of aten operators run in a compiled step: only the
    # leaf's replay runs any (compiled backwards call aten without autograd).
    ("replayed backward nodes",
     r"torch::autograd::generated::\w+::apply\(std::vector<at::Tensor, std::allocator<at::Tensor> >&&\) \["),
)
_ANNOTATED = re.compile(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+([<*>])\s+(.*)$")
_CALLS = re.compile(r"\(([\d,]+)x\) \[")


def _parts(out_file, n):
    """{part: (thousands of instructions per call, calls per call)} for
    PARTS in one callgrind output of ``n`` calls. Counts are inclusive: a
    part's callees are in it."""
    text = subprocess.run(
        ["callgrind_annotate", "--show=Ir", "--tree=caller", "--inclusive=yes", "--threshold=100", out_file],
        capture_output=True, text=True, check=True,
    ).stdout
    found = {part: [0, 0] for part, _ in PARTS}
    calls = 0  # from the caller lines ("<") above a function's line ("*")
    for line in text.splitlines():
        m = _ANNOTATED.match(line)
        if m is None:
            calls = 0
            continue
        cost, kind, rest = int(m.group(1).replace(",", "")), m.group(2), m.group(3)
        if kind == "<":
            c = _CALLS.search(rest)
            calls += int(c.group(1).replace(",", "")) if c else 0
            continue
        if kind == "*":
            for part, pattern in PARTS:
                if re.search(pattern, rest):
                    found[part][0] += cost
                    found[part][1] += calls
        calls = 0
    return {part: (ir / n / 1e3, c / n) for part, (ir, c) in found.items()}


def _count(name, n, keep=None, valgrind_args=(), parts=False):
    with tempfile.TemporaryDirectory() as tmp:
        ready, done = os.path.join(tmp, "ready"), os.path.join(tmp, "done")
        log = os.path.join(tmp, "log")
        # A private Inductor cache: under Valgrind, which has no AVX-512,
        # Inductor writes 8-wide vector loops, and PyTorch 2.13's FX graph
        # cache key does not include the vector ISA. A native process that
        # loaded such a graph from the shared cache would compile its kernels
        # 16-wide and store past the ends of its buffers (heap corruption:
        # "double free or corruption" in the next `make bench`).
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
        child = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/out", *valgrind_args,
             f"--log-file={log}", os.path.realpath(sys.executable), os.path.abspath(__file__),
             "--child", name, "--n", str(n), "--ready", ready, "--done", done],
            env=env,
        )
        for path, command in ((ready, "on"), (done, "off")):
            while not os.path.exists(path):
                if child.poll() is not None:
                    raise RuntimeError(f"stage {name!r} exited early; see {log}")
                time.sleep(0.2)
            time.sleep(0.2)
            subprocess.run(["callgrind_control", "-i", command, str(child.pid)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        child.wait()
        if keep:
            os.makedirs(keep, exist_ok=True)
            shutil.copy(f"{tmp}/out", os.path.join(keep, name.replace(" ", "_").replace(":", "") + ".out"))
        with open(log) as f:
            refs = [line for line in f if "Collected" in line]
        # (Instructions come first; cache or branch simulation adds columns.)
        count = int(refs[-1].split(":")[-1].replace(",", "").split()[0]) / n
        return (count, _parts(f"{tmp}/out", n)) if parts else count


# What `make bench` counts for BENCHMARKS.md (report.instructions_markdown).
BENCH_STAGES = (
    "step: plain", "step: custom_op", "step: torchleaf",
    "inductor step: plain", "inductor step: custom_op", "inductor step: torchleaf",
    "forward op", "custom_op op", "forward+backward ops", "body", "body recording autograd",
)


def part_key(stage, part, calls=False):
    """The key of a step stage's part in run()'s counts."""
    return f"{stage} | {part}" + (" | calls" if calls else "")


def run(stages=BENCH_STAGES, n=100, jobs=2, log=print):
    """{stage: thousands of instructions per call}, ``jobs`` stages at a
    time (callgrind runs one process on one core; counts do not depend on
    the load), and for each compiled step stage its PARTS (part_key: thousands
    of instructions, calls per step). Raises RuntimeError without valgrind."""
    import concurrent.futures

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("valgrind is not installed (apt-get install valgrind)")
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        split = {name for name in stages if "step: " in name}
        futures = {name: pool.submit(_count, name, n, parts=name in split) for name in stages}
        counts = {}
        for name, future in futures.items():
            count, parts = future.result() if name in split else (future.result(), {})
            counts[name] = count / 1e3
            log(f"  {name}: {counts[name]:.1f}k")
            for part, (k, calls) in parts.items():
                counts[part_key(name, part)] = k
                counts[part_key(name, part, calls=True)] = calls
    return counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--stages", help="comma-separated stage names (default: all)")
    parser.add_argument("--keep", help="copy each stage's callgrind output into this folder "
                        "(for callgrind_annotate / kcachegrind)")
    parser.add_argument("--valgrind-arg", action="append", default=[],
                        help="extra valgrind option, e.g. --valgrind-arg=--cache-sim=yes (with --keep)")
    parser.add_argument("--child")
    parser.add_argument("--ready")
    parser.add_argument("--done")
    args = parser.parse_args()
    if args.child:
        return _child(args.child, args.n, args.ready, args.done)
    print("| stage | what | instructions per call (thousands) |\n|---|---|---:|")
    chosen = args.stages.split(",") if args.stages else [name for name, _ in STAGES]
    for name, what in STAGES:
        if name not in chosen:
            continue
        print(f"| {name} | {what} | {_count(name, args.n, args.keep, args.valgrind_arg) / 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
