"""BENCHMARKS.md, the targets and docs/overhead.png from measured results."""

import os
import platform
import subprocess

import torch

from implementations import BODIES, IMPLEMENTATIONS
from instructions import part_key
from overhead import MODES, Unsupported

LABELS = {impl.key: impl.label for impl in IMPLEMENTATIONS}
MODE_LABELS = {mode.key: mode.label for mode in MODES}


# ------------------------------------------------------------------- machine
def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_revision(root):
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
        return rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def machine_info(root):
    return {
        "CPU": _cpu_model(),
        "Cores (os.cpu_count)": os.cpu_count(),
        "torch intra-op threads (set by the benchmark)": torch.get_num_threads(),
        "torch": torch.__version__,
        "Python": platform.python_version(),
        "OS": platform.platform(),
        "torchleaf revision": _git_revision(root),
    }


# ------------------------------------------------------------------- numbers
def overhead(results, body, mode, impl):
    """Per-call time above the plain implementation's, in µs (None if n/a)."""
    t, plain = results.get((body, mode, impl)), results.get((body, mode, "plain"))
    if t is None or isinstance(t, Unsupported) or plain is None:
        return None
    return t.median_us - plain.median_us


def ratio(numerator, denominator):
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _fmt(x, digits=1, suffix=""):
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def compute_ratios(results):
    """Ratios of overheads measured in the same process, for each body."""
    rows = []
    for body in BODIES:
        for label, mode, other in (
            ("torchleaf / autograd.Function", "eager_fwdbwd", "autograd_function"),
            ("torchleaf / custom_op", "eager_fwdbwd", "custom_op"),
            ("torchleaf / built-in leaf_function", "aot_eager_fwdbwd", "builtin_leaf"),
            ("torchleaf / custom_op", "aot_eager_fwdbwd", "custom_op"),
            ("torchleaf / autograd.Function", "aot_eager_fwdbwd", "autograd_function"),
            ("torchleaf / graph break", "aot_eager_fwdbwd", "graph_break"),
            ("torchleaf / custom_op", "inductor_fwdbwd", "custom_op"),
        ):
            mine = overhead(results, body.name, mode, "torchleaf")
            theirs = overhead(results, body.name, mode, other)
            rows.append((body.name, MODE_LABELS[mode], label, mine, theirs, ratio(mine, theirs)))
    return rows


def compute_targets(results, cpp, memory, instructions=None):
    """[(target, measured, PASS/MISS/n/a)]"""
    targets = []

    def add(name, measured, ok):
        targets.append((name, measured, "n/a" if ok is None else ("PASS" if ok else "MISS")))

    def ovh(mode, impl, body="small"):
        return overhead(results, body, mode, impl)

    tl, builtin = ovh("aot_eager_fwdbwd", "torchleaf"), ovh("aot_eager_fwdbwd", "builtin_leaf")
    add(
        "compile(aot_eager) fwd+bwd: torchleaf overhead ≤ 1/8 of built-in leaf_function's",
        f"{_fmt(tl)} µs vs {_fmt(builtin)} µs (ratio {_fmt(ratio(tl, builtin), 3)})",
        None if tl is None or builtin is None else tl <= builtin / 8,
    )
    for body in ("small", "medium"):
        for mode in ("aot_eager", "inductor"):
            tl, custom = ovh(f"{mode}_fwdbwd", "torchleaf", body), ovh(f"{mode}_fwdbwd", "custom_op", body)
            add(
                f"compile({mode}) fwd+bwd, {body} body: torchleaf overhead ≤ custom_op's",
                f"{_fmt(tl)} µs vs {_fmt(custom)} µs (ratio {_fmt(ratio(tl, custom), 2)})",
                None if tl is None or custom is None else tl <= custom,
            )
    # The same comparison in instructions per step (callgrind, this run),
    # which the machine's load does not move: on a shared VM the wall-clock
    # rows above can differ by more than the step's real difference.
    if isinstance(instructions, dict):
        for mode, prefix in (("aot_eager", "step: "), ("inductor", "inductor step: ")):
            tl, custom = instructions.get(prefix + "torchleaf"), instructions.get(prefix + "custom_op")
            parts = inductor_step_parts(instructions) if mode == "inductor" else None
            parts = None if isinstance(parts, str) else parts
            add(
                f"compile({mode}) fwd+bwd, small body, in CPU instructions per step (callgrind; "
                "processes differ by up to ~5k): torchleaf ≤ custom_op",
                f"{_fmt(tl)}k vs {_fmt(custom)}k"
                + ("" if tl is None or custom is None else f" ({tl - custom:+.1f}k)")
                + ("" if parts is None else
                   f"; {parts['structural']:.1f}k of it is the replay's structure, {parts['rest']:+.1f}k the rest "
                   "(see \"Where the compiled overhead goes\")"),
                None if tl is None or custom is None else tl <= custom,
            )
    tl, fn = ovh("eager_fwdbwd", "torchleaf"), ovh("eager_fwdbwd", "autograd_function")
    add(
        "eager fwd+bwd: torchleaf overhead ≤ 1.5× hand-written autograd.Function's",
        f"{_fmt(tl)} µs vs {_fmt(fn)} µs (ratio {_fmt(ratio(tl, fn), 2)})",
        None if tl is None or fn is None else tl <= 1.5 * fn,
    )
    for kind in ("Fwd", "FwdBwd"):
        diff = cpp_difference(cpp, kind)
        add(
            f"C++ {'fwd' if kind == 'Fwd' else 'fwd+bwd'}: leaf ≤ 2 µs above hand-written "
            "torch::autograd::Function",
            f"{_fmt(diff, 2)} µs above" if diff is not None else "C++ benchmark did not run",
            None if diff is None else diff <= 2.0,
        )
    peak = memory.get("peak", {})
    if "plain" in peak and "torchleaf" in peak:
        plain, leaf = peak["plain"]["increment_mib"], peak["torchleaf"]["increment_mib"]
        add(
            "peak memory of fwd+bwd within 5% of the undecorated function",
            f"{leaf:.1f} MiB vs {plain:.1f} MiB above baseline ({100 * (leaf / plain - 1):+.1f}%)",
            leaf <= 1.05 * plain,
        )
    growth = memory.get("growth", {}).get("torchleaf")
    if growth:
        add(
            f"no growth over {growth['calls']:,} fwd+bwd calls (RSS growth < 1 MiB, live_states unchanged)",
            f"RSS {growth['rss_before_mib']:.1f} → {growth['rss_after_mib']:.1f} MiB "
            f"({growth['growth_mib']:+.2f} MiB), live_states {growth['live_states_before']} → "
            f"{growth['live_states_after']}",
            growth["growth_mib"] < 1.0 and growth["live_states_after"] == growth["live_states_before"],
        )
    return targets


def cpp_difference(cpp, kind):
    """C++ leaf time minus hand-written Function time (µs) for Fwd/FwdBwd."""
    res = (cpp or {}).get("results", {})
    leaf, fn = res.get(f"BM_Leaf_{kind}"), res.get(f"BM_Function_{kind}")
    if leaf is None or fn is None:
        return None
    return leaf["time_us"] - fn["time_us"]


# ------------------------------------------------------------------ markdown
def _python_table(results, body, footnotes):
    modes = [m for m in MODES]
    lines = [
        "| implementation | " + " | ".join(m.label for m in modes) + " |",
        "|---|" + "---:|" * len(modes),
    ]
    for impl in IMPLEMENTATIONS:
        cells = []
        for mode in modes:
            r = results.get((body.name, mode.key, impl.key))
            if r is None:
                cells.append("—")
            elif isinstance(r, Unsupported):
                footnotes.append(f"{impl.label}, {body.name} body, {mode.label}: **{r.error}**: {r.reason}")
                cells.append(f"not supported [{len(footnotes)}]")
            elif impl.key == "plain":
                cells.append(f"{r.median_us:.1f}")
            else:
                cells.append(f"{r.median_us:.1f} ({overhead(results, body.name, mode.key, impl.key):+.1f})")
        lines.append(f"| {impl.label} | " + " | ".join(cells) + " |")
    return lines


def inductor_step_parts(counts):
    """What the leaf's Inductor step executes that custom_op's does not, by
    part (thousands of instructions per step, from the same run's counts):
    {"asserts": (custom_op, leaf), "asserts calls": (custom_op, leaf),
    "replayed": leaf, "recording": leaf, "step": (custom_op, leaf),
    "structural": the three parts' sum over custom_op's, "rest": the step's
    difference less that}; None where something was not counted, and a
    string saying why where the parts were counted but found nothing."""
    if not isinstance(counts, dict):
        return None
    tl, co = "inductor step: torchleaf", "inductor step: custom_op"
    keys = (tl, co, part_key(tl, "size asserts"), part_key(co, "size asserts"),
            part_key(tl, "replayed backward nodes"), "body recording autograd", "body")
    if any(counts.get(key) is None for key in keys):
        return None
    # Both Inductor steps assert sizes and the leaf's always replays: zero
    # means callgrind found no function by that name (PyTorch renamed it),
    # not that the part costs nothing.
    if not counts[part_key(co, "size asserts")] or not counts[part_key(tl, "replayed backward nodes")]:
        return ("not split: callgrind found no `assert_size_stride` or no "
                "`torch::autograd::generated::*::apply` in the Inductor steps (renamed in this PyTorch?)")
    asserts = (counts[part_key(co, "size asserts")], counts[part_key(tl, "size asserts")])
    replayed = counts[part_key(tl, "replayed backward nodes")] - counts.get(part_key(co, "replayed backward nodes"), 0.0)
    recording = counts["body recording autograd"] - counts["body"]
    structural = asserts[1] - asserts[0] + replayed + recording
    return {
        "step": (counts[co], counts[tl]),
        "asserts": asserts,
        "asserts calls": (counts.get(part_key(co, "size asserts", calls=True)),
                          counts.get(part_key(tl, "size asserts", calls=True))),
        "replayed": replayed,
        "recording": recording,
        "structural": structural,
        "rest": counts[tl] - counts[co] - structural,
    }


def _inductor_parts_markdown(parts):
    if parts is None:
        return []
    if isinstance(parts, str):
        return [f"The leaf's Inductor step was {parts}.", ""]
    (co, tl), (aco, atl) = parts["step"], parts["asserts"]
    nco, ntl = parts["asserts calls"]

    def calls(n):
        return "" if n is None else f" ({n:.0f} calls)"

    return [
        "What the leaf's Inductor step executes that custom_op's does not (thousands of instructions "
        "per step, this run; the asserts and the replayed nodes are callgrind's inclusive counts of "
        "PyTorch's functions `assert_size_stride` and `torch::autograd::generated::*::apply` in the "
        "step stages, the recording is the stage difference above):",
        "",
        "| part | custom_op | torchleaf | difference | why the leaf has it |",
        "|---|---:|---:|---:|---|",
        f"| the whole step | {co:.1f} | {tl:.1f} | {tl - co:+.1f} | |",
        f"| Inductor's size asserts | {aco:.1f}{calls(nco)} | {atl:.1f}{calls(ntl)} | {atl - aco:+.1f} | "
        "the graph inputs and the leaf's real outputs (user code); the state handle and the backward "
        "operator's gradients, which the core guarantees, are not checked |",
        f"| the body's backward nodes, replayed | — | {parts['replayed']:.1f} | {parts['replayed']:+.1f} | "
        "a leaf's backward is the graph its body recorded, run as eager autograd nodes; custom_op's "
        "hand-written formula is compiled into the backward kernel |",
        f"| recording that graph in the forward | — | {parts['recording']:.1f} | {parts['recording']:+.1f} | "
        "the capture itself |",
        f"| everything else | {co - aco:.1f} | {tl - atl - parts['replayed'] - parts['recording']:.1f} | "
        f"{parts['rest']:+.1f} | operator entries, state lookup and release, the order token |",
        "",
        "The replayed nodes and the recording are what a replayed backward is under Inductor 2.13; "
        "they cannot go without giving up the replay (a hand-written backward). Inductor asserts the "
        "size and stride of each graph input and extern kernel output it relies on; the leaf's "
        "lowering drops those of the state handle (made by the core, read only by the backward "
        "operator) and of the backward operator's gradients (validated against each input's metadata "
        "by the replay and made contiguous), as custom_op's traced backward has none. The last row "
        "is what is left to shave.",
        "",
    ]


def instructions_markdown(counts):
    """The instruction-count section: where the compiled overhead goes."""
    out = [
        "## Where the compiled overhead goes (CPU instructions)",
        "",
        "Counted in this run by `python benchmarks/instructions.py` under Valgrind's callgrind: each "
        "stage in its own process, instrumentation on only around its calls, so a row is what one "
        "call executes whatever the machine's load (processes of one stage differ by up to ~5k per "
        "step). Small body, thousands of instructions.",
        "",
    ]
    if isinstance(counts, str):
        return out + [f"Not counted: {counts}", ""]
    k = counts.get

    def over(stage, base):
        return None if k(stage) is None or k(base) is None else k(stage) - k(base)

    def plus(x):
        return "n/a" if x is None else f"+{x:.1f}"

    out += ["| fwd+bwd step | aot_eager | over plain | inductor | over plain |", "|---|---:|---:|---:|---:|"]
    for impl in ("plain", "custom_op", "torchleaf"):
        a, i = f"step: {impl}", f"inductor step: {impl}"
        if impl == "plain":
            out.append(f"| {impl} | {_fmt(k(a))} | — | {_fmt(k(i))} | — |")
            continue
        out.append(
            f"| {impl} | {_fmt(k(a))} | {plus(over(a, 'step: plain'))} | {_fmt(k(i))} | "
            f"{plus(over(i, 'inductor step: plain'))} |"
        )
    backward = over("forward+backward ops", "forward op")
    recording = over("body recording autograd", "body")
    out += [
        "",
        "| one call of | thousands of instructions |",
        "|---|---:|",
        f"| `torchleaf.forward`, as a compiled graph calls it (the body recording autograd included) | {_fmt(k('forward op'))} |",
        f"| the custom_op's operator, as its compiled graph calls it (its body without recording) | {_fmt(k('custom_op op'))} |",
        f"| `torchleaf.backward`: the replay of the graph the body recorded (forward+backward operators minus forward) | {_fmt(backward)} |",
        f"| the body, autograd off | {_fmt(k('body'))} |",
        f"| autograd recording inside the body (body on an input that requires grad, minus the above) | {_fmt(recording)} |",
        "",
        "What a leaf pays that a custom_op with a hand-written backward does not: its backward is a "
        f"replay of the graph its body recorded ({_fmt(backward)}k per call, the body's own backward "
        f"nodes included), and recording that graph ({_fmt(recording)}k). custom_op's backward is its "
        "hand-written formula, traced into the graph. Under aot_eager that formula runs as aten "
        "operators, and the leaf's forward operator, cheaper than custom_op's, evens the step out. "
        "Under Inductor the formula becomes part of a compiled kernel, almost free, while the leaf "
        "still replays. A leaf exists for bodies that cannot be traced, so its backward cannot be compiled: "
        "matching custom_op under Inductor would take a hand-written backward, custom_op's own "
        "surface. Wall-clock figures above can disagree with these counts by several µs either "
        "way on a shared machine; the counts do not move with its load. "
        "docs/profile.md breaks the step down further.",
        "",
    ]
    return out + _inductor_parts_markdown(inductor_step_parts(counts))


# Libraries shown apart in the time-by-library table; the rest is summed.
_TIME_LIBRARIES = (
    ("libpython3.11.so.1.0", "the Python interpreter"),
    ("libtorch_python.so", "libtorch_python (bindings, Dynamo guards)"),
    ("libtorch_cpu.so", "libtorch_cpu (operators, autograd)"),
    ("libc10.so", "libc10"),
    ("libc.so.6", "libc (malloc, free, memcpy)"),
    ("libtorchleaf.so", "libtorchleaf"),
    ("torchleaf _C", "torchleaf's `_C`"),
)


def time_by_library_markdown(by_library):
    """Where the aot_eager step's time goes, by library (perf samples), for
    custom_op and the leaf (time_shares.by_library)."""
    out = [
        "## Where the compiled step's time goes (by library)",
        "",
        "Measured in this run by `time_shares.by_library` (`python benchmarks/time_shares.py` adds "
        "instruction shares): perf's cpu-clock samples of 20,000 aot_eager fwd+bwd steps (small "
        "body) of each variant in a process of its own, in µs per step. Sampling at 10 kHz makes "
        "every step slower, so compare the two columns with each other only.",
        "",
    ]
    if isinstance(by_library, str):
        return out + [f"Not measured: {by_library}", ""]
    custom, leaf = by_library["step: custom_op"], by_library["step: torchleaf"]
    out += ["| library | custom_op | torchleaf | difference |", "|---|---:|---:|---:|"]
    shown = set()
    for lib, label in _TIME_LIBRARIES:
        shown.add(lib)
        a, b = custom["libraries"].get(lib, 0.0), leaf["libraries"].get(lib, 0.0)
        out.append(f"| {label} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    a = sum(v for lib, v in custom["libraries"].items() if lib not in shown)
    b = sum(v for lib, v in leaf["libraries"].items() if lib not in shown)
    out.append(f"| everything else | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    out.append(f"| the whole step | {custom['step_us']:.1f} | {leaf['step_us']:.1f} | "
               f"{leaf['step_us'] - custom['step_us']:+.1f} |")
    out += [
        "",
        "At equal instruction counts the leaf's step moves work from the interpreter and "
        "libtorch_python into C++: libtorch_cpu records the body's autograd graph, replays its "
        "nodes and frees it, and torchleaf's own libraries capture, keep and replay it. That C++ "
        "runs once per step and costs 2-3x the time per instruction of the interpreter's hot loop, "
        "so the leaf's wall-clock overhead is above custom_op's while its instruction count is not "
        "(not for want of cache: clearing L2 between steps leaves the gap unchanged, "
        "docs/profile.md). The recording and the replayed nodes are what a leaf is (a backward "
        "that is not hand-written); docs/profile.md (\"Wall-clock time\") has the per-symbol "
        "detail and the changes made against it.",
        "",
    ]
    return out


def capture_split_markdown(split):
    """The compiled step without capture, with it, and with its replay
    (capture_split.run)."""
    import capture_split

    return [
        "## Where the compiled overhead goes (wall clock)",
        "",
        "Measured in this run by `python benchmarks/capture_split.py`: the small body's compiled step "
        "in three forms, each its own compiled function, all timed interleaved in one process. "
        "*forward, no grad*: the input does not require grad, so nothing is recorded; the leaf pays "
        "its seam alone (operator entry, Python runner, output description). *forward, grad*: the "
        "outputs are dropped without backward; the leaf also records its body's autograd graph and "
        "makes and frees its state and handle, custom_op runs its setup_context. *forward + "
        "backward*: the step of the tables above; the leaf replays the recorded graph, custom_op "
        "runs its hand-written formula (under Inductor compiled into the backward graph's kernel). "
        "The differences between rows split the leaf's extra time into its seam, its capture and "
        "its replay.",
        "",
        *capture_split.markdown(split),
        "",
        "The capture and the replay are what a leaf is: its body cannot be traced, so its backward "
        "is the graph the body recorded, run node by node. Matching a custom_op whose backward is a "
        "formula traced into the graph would take a hand-written backward, custom_op's own surface.",
        "",
    ]


def structure_markdown(structure):
    """Calls per graph, and a leaf's structure built from custom_op
    (structure.run)."""
    import structure as structure_module

    out = [
        "## Per call or per step, and the structure a leaf needs (wall clock)",
        "",
        "Measured in this run by `python benchmarks/structure.py`, each variant its own compiled "
        "function, all timed interleaved in one process, overheads over plain code with as many "
        "calls. *Calls per graph*: the small body chained 1, 2 and 4 times in one compiled fwd+bwd "
        "step; the slope is what each call after the first costs, the rest is paid once per step "
        "whatever the number of calls. *Structure*: custom_op given what a leaf cannot do without: "
        "a backward that is an opaque operator (a leaf's body cannot be traced, so its backward "
        "cannot either), then also a handle from the forward that the backward operator takes (how "
        "a leaf's backward finds the graph its forward recorded, with no state hidden between "
        "calls). Those two variants record and replay nothing; torchleaf does both. The handle "
        "is a tensor because it owns what it names: the state is freed with the graph that saved "
        "it, also when no backward runs. A variant whose handle is an int (which the graph "
        "saves as a Python int, not a tensor) measures what that ownership costs; an int owns "
        "nothing, so a leaf with such a handle would leak every state whose graph was dropped "
        "without a backward.",
        "",
        *structure_module.markdown(structure),
        "",
    ]
    slope, once = structure_module.slope, structure_module.once
    for backend, rows in structure.items():
        c, h, t = rows["custom_op"], rows[structure_module.HANDLE], rows["torchleaf"]
        token = t[1] - rows[structure_module.NO_STORE][1]
        owning = h[1] - rows[structure_module.INT_HANDLE][1]
        out.append(
            f"- {backend}: each call after the first, torchleaf {slope(t):+.1f} µs against custom_op's "
            f"{slope(c):+.1f}; paid once per step, {once(t):+.1f} against {once(c):+.1f}, of which the "
            f"order token's store {token:+.1f}. custom_op given an opaque backward and a handle, "
            f"recording and replaying nothing: {slope(h):+.1f} per call, {once(h):+.1f} once per step; "
            f"a tensor handle rather than an int (what owning the state costs, one call): {owning:+.1f}."
        )
    out += [
        "",
        "The per-call column is what each call after a step's first costs; the once-per-step "
        "column is what a step pays for having such calls at all. custom_op given an opaque "
        "backward operator and a handle saved for it, the structure a leaf cannot do without, "
        "shows what that structure costs without recording or replaying anything. Beyond it, a "
        "leaf's step pays the store of its last call's order token, a graph output that keeps "
        "every call live whatever the use of its outputs (the compilers remove a call whose "
        "outputs nothing uses; without the store, a leaf called for its side effects would "
        "silently not run).",
        "",
    ]
    return out


def markdown(*, info, settings_note, results, cpp, cpp_error, memory, targets, plot_name, load, elapsed_s, module=None, heavy=None,
             instructions=None, by_library=None, split=None, structure=None):
    out = ["# torchleaf benchmarks", ""]
    out += [
        "Generated by `make bench` (`python benchmarks/run.py`); do not edit by hand. "
        "Every figure below was measured in this run.",
        "",
        "## Machine and versions",
        "",
    ]
    out += [f"- **{k}**: {v}" for k, v in info.items()]
    if cpp and cpp.get("context"):
        ctx = cpp["context"]
        out.append(
            f"- **Google Benchmark**: library build type `{ctx.get('library_build_type', '?')}` "
            "(the Debian package reports `debug`; the benchmark executable and libtorchleaf are built "
            "`Release`)"
        )
    out.append(
        f"- **Load average** (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f} "
        "(the machine may be shared; interleaved timing spreads noise over all variants)"
    )
    out.append(f"- **Run time**: {elapsed_s:.0f} s; {settings_note}")
    out += ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    out += [f"| {name} | {measured} | **{verdict}** |" for name, measured, verdict in targets]
    out += [
        "",
        "Overheads are per-call time minus the plain (inline) implementation's in the same mode, "
        "small body, in µs.",
        "",
        "## Per-call time, Python",
        "",
        "Median per-call time in µs; in parentheses the overhead over plain inline code in the same "
        "mode and process. `eager fwd` runs the forward with inputs that require grad (the autograd "
        "graph is recorded); `fwd+bwd` runs `impl(*inputs).sum().backward()`; compiled modes compile "
        "that loss with `torch.compile(fullgraph=True)` (the graph-break variant with "
        "`fullgraph=False`, which it needs by construction).",
        "",
    ]
    footnotes = []
    for body in BODIES:
        out += [f"### {body.name} body: {body.description}", ""]
        out += _python_table(results, body, footnotes)
        out.append("")
    if footnotes:
        out += [f"[{i}] {note}" for i, note in enumerate(footnotes, 1)]
        out.append("")
    if module:
        import module_args

        out += [f"### large module: {module_args.DESCRIPTION}", ""]
        out += [
            "A leaf that takes the module as an argument (`leaf(model, x)` running `model(x)`), "
            "against calling the model inline; same modes and method as above, fewer rounds "
            "(`python benchmarks/module_args.py` runs only this table). Each parameter is an operator "
            "input, so the leaf's extra time grows with the number of parameters; nothing else does.",
            "",
        ]
        out += module_args.markdown(module)
        out.append("")
    if heavy:
        import leaf_heavy

        out += ["## Per-step time of a leaf-heavy model", "", leaf_heavy.DESCRIPTION + ".", ""]
        out += [
            "Each step in ms, with the ratio to plain code in the same mode (`python "
            "benchmarks/leaf_heavy.py` runs only this table; `--cold-compile` the cold Inductor "
            "compile). The leaf's body runs eagerly in every mode (it is opaque to the compiler), so "
            "under Inductor the floor is the plain model run eagerly; docs/profile.md has the breakdown.",
            "",
            leaf_heavy.table(heavy),
            "",
        ]
    out += [f"![per-call overhead]({plot_name})", ""]
    if split is not None:
        out += capture_split_markdown(split)
    if structure is not None:
        out += structure_markdown(structure)
    if instructions is not None:
        out += instructions_markdown(instructions)
    if by_library is not None:
        out += time_by_library_markdown(by_library)
    out += [
        "### Overhead ratios (same process)",
        "",
        "| body | mode | comparison | torchleaf overhead (µs) | other overhead (µs) | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for body, mode, label, mine, theirs, r in compute_ratios(results):
        out.append(f"| {body} | {mode} | {label} | {_fmt(mine)} | {_fmt(theirs)} | {_fmt(r, 2)} |")
    out += [
        "",
        "n/a: the other overhead is ≤ 0, so the ratio is undefined. Under torch.compile, "
        "autograd.Function is traced through (not opaque), so its compiled overhead is ≈ 0 by "
        "design. For the medium body the overheads are small differences of large, noisier times; "
        "read them as an order of magnitude.",
        "",
        "## Per-call time, C++ (Google Benchmark)",
        "",
    ]
    if cpp_error:
        out += ["**The C++ benchmark FAILED** (build or run):", "", "```", cpp_error.strip()[-3000:], "```", ""]
    else:
        out += [
            "Small body `x * 2 + 1` on 64 float32, x requires grad; fwd+bwd also runs "
            "`y.sum().backward()`. Median of repetitions, real time.",
            "",
            "| variant | fwd (µs) | fwd+bwd (µs) | fwd+bwd overhead over plain (µs) |",
            "|---|---:|---:|---:|",
        ]
        res = cpp["results"]
        plain_fb = res["BM_Plain_FwdBwd"]["time_us"]
        for name, label in (("Plain", "plain (inline)"), ("Function", "torch::autograd::Function"), ("Leaf", "torchleaf leaf")):
            fwd, fb = res[f"BM_{name}_Fwd"]["time_us"], res[f"BM_{name}_FwdBwd"]["time_us"]
            out.append(f"| {label} | {fwd:.2f} | {fb:.2f} | {fb - plain_fb:+.2f} |")
        out += [
            "",
            "Backward alone (fwd+bwd minus fwd): "
            + ", ".join(
                f"{label} {res[f'BM_{name}_FwdBwd']['time_us'] - res[f'BM_{name}_Fwd']['time_us']:.2f} µs"
                for name, label in (("Plain", "plain"), ("Function", "Function"), ("Leaf", "leaf"))
            )
            + ". An eager leaf's backward is the body's own autograd graph, wired into the caller's "
            "graph (here MulBackward and AddBackward, as for plain code); the hand-written Function "
            "runs one node. What the leaf adds beyond that is in its forward.",
            "",
            f"Leaf minus hand-written Function: fwd {cpp_difference(cpp, 'Fwd'):+.2f} µs, "
            f"fwd+bwd {cpp_difference(cpp, 'FwdBwd'):+.2f} µs. "
            f"torchleaf::live_states() after each benchmark: "
            f"{sorted({int(r['live_states']) for r in res.values() if r['live_states'] is not None})}.",
            "",
        ]
    out += ["## Memory", ""]
    peak = memory.get("peak", {})
    if peak:
        plain = peak["plain"]["increment_mib"]
        out += [
            "Three training steps (grads set to None, forward, backward of `.sum()`) of "
            "`relu(tanh(x @ w1) @ w2)` with x, w1, w2 1024x1024 float32 requiring grad, each variant "
            "in a fresh subprocess (one torch thread, `MALLOC_MMAP_THRESHOLD_=65536` so that freed "
            "tensors leave the resident set at once). Peak = VmHWM; increment = peak minus the "
            f"resident size before the steps (median of {peak['plain']['runs']} subprocesses).",
            "",
            "| variant | resident before (MiB) | peak (MiB) | increment (MiB) | vs plain |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, label in (("plain", "undecorated"), ("torchleaf", "torchleaf leaf"),
                            ("autograd_function", "hand-written autograd.Function (control)")):
            p = peak.get(name)
            if p:
                out.append(
                    f"| {label} | {p['rss_before_mib']:.1f} | {p['hwm_after_mib']:.1f} | "
                    f"{p['increment_mib']:.1f} | {100 * (p['increment_mib'] / plain - 1):+.1f}% |"
                )
        out += [
            "",
            "Control row: a hand-written autograd.Function has one backward node for the whole body, "
            "so its saved activations and all its input gradients are alive together until that node "
            "finishes, while the undecorated graph frees each op's saved tensors as soon as that op's "
            "backward has run.",
            "",
        ]
    growth = memory.get("growth", {})
    if growth:
        out += [
            "Resident size (/proc/self/statm) before and after forward+backward calls of the small "
            "body (x: 64 float32), in a fresh subprocess after 1,000 warm-up calls:",
            "",
            "| variant | calls | RSS before (MiB) | RSS after (MiB) | growth (MiB) | live_states before → after |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, label in (("plain", "undecorated (control)"), ("torchleaf", "torchleaf leaf")):
            g = growth.get(name)
            if g:
                out.append(
                    f"| {label} | {g['calls']:,} | {g['rss_before_mib']:.2f} | {g['rss_after_mib']:.2f} | "
                    f"{g['growth_mib']:+.2f} | {g['live_states_before']} → {g['live_states_after']} |"
                )
        out.append("")
    out += [
        "## Method",
        "",
        "- All Python variants of one (body, mode) pair are timed in one process, round-robin: each "
        "round runs one batch of back-to-back calls of every variant, timed with "
        "`time.perf_counter_ns`; the reported time is the median over rounds of the batch means, "
        "after one warm-up batch each (and, for compiled modes, after compilation). The garbage "
        "collector is off while timing.",
        "- Before timing, every variant's loss value and input gradients are checked against plain "
        "code. Each compiled variant has its own code object, so no variant pays for another's "
        "Dynamo guards.",
        "- Implementations: plain inline code (the floor); `torch.autograd.Function` with a "
        "hand-written backward; `torch.library.custom_op` + `register_fake` + `register_autograd` "
        "(called through the decorated object, as users do); "
        "`torch._dynamo.decorators.leaf_function` + `register_fake`; `torch.compiler.disable` on the "
        "body (graph break; compiled modes only); `torchleaf.leaf_function` + `register_fake`.",
        "- C++: Google Benchmark, `--benchmark_repetitions` with random interleaving, median "
        "aggregate; one intra-op thread.",
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------- plot
def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [impl for impl in IMPLEMENTATIONS if impl.key != "plain"]
    fig, axes = plt.subplots(1, len(BODIES), figsize=(13, 4.8), sharey=False)
    width = 0.8 / len(impls)
    for ax, body in zip(axes, BODIES):
        for i, impl in enumerate(impls):
            xs, ys, missing = [], [], []
            for m, mode in enumerate(MODES):
                x = m + (i - (len(impls) - 1) / 2) * width
                r = results.get((body.name, mode.key, impl.key))
                if isinstance(r, Unsupported):
                    missing.append(x)
                ovh = overhead(results, body.name, mode.key, impl.key)
                if ovh is not None:
                    xs.append(x)
                    ys.append(ovh)
            ax.bar(xs, ys, width, label=impl.label)
            for x in missing:
                ax.text(x, 1.2, "not supported", rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(MODES)))
        ax.set_xticklabels([m.label.replace(" fwd", "\nfwd") for m in MODES], fontsize=8)
        ax.set_ylabel("overhead over plain code per call (µs, symlog)")
        ax.set_title(f"{body.name} body: {body.description.replace('`', '')}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Per-call overhead (torch {torch.__version__}, {_cpu_model()}, {os.cpu_count()} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_as_json(results):
    out = {}
    for (body, mode, impl), r in results.items():
        out.setdefault(body, {}).setdefault(mode, {})[impl] = r.__dict__.copy()
    return out
