"""Run every torchleaf benchmark and write the report.

    python benchmarks/run.py            # full run: BENCHMARKS.md, docs/overhead.png
    python benchmarks/run.py --quick    # smoke run: few repetitions, temp dir
    python benchmarks/run.py --quick --out DIR

Full runs write BENCHMARKS.md and docs/overhead.png in the repository; runs
with --quick or --out write BENCHMARKS.md, overhead.png and results.json in
the output directory (a new temporary one by default for --quick), so tests
never rewrite committed files. Exits nonzero if any benchmark crashes or the
C++ suite fails to build or run; missed targets are reported, not fatal.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import capture_split
import cpp_bench
import instructions
import leaf_heavy
import module_args
import overhead
import report
import structure
import time_shares

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def log(msg):
    print(msg, flush=True)


def _memory_subprocess(*args):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "memory.py"), *map(str, args)],
        capture_output=True, text=True, env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory benchmark {' '.join(map(str, args))} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_memory(quick):
    runs = 1 if quick else 3
    calls = 2_000 if quick else 100_000
    peak = {}
    for variant in ("plain", "torchleaf", "autograd_function"):
        samples = sorted((_memory_subprocess("peak", variant) for _ in range(runs)), key=lambda r: r["increment_mib"])
        peak[variant] = dict(samples[len(samples) // 2], runs=runs)
        log(f"  peak {variant}: +{peak[variant]['increment_mib']:.1f} MiB")
    growth = {}
    for variant in ("plain", "torchleaf"):
        growth[variant] = _memory_subprocess("growth", variant, calls)
        log(f"  growth {variant}: {growth[variant]['growth_mib']:+.2f} MiB over {calls:,} calls")
    return {"peak": peak, "growth": growth}


def _tool_measurement(title, measure):
    """measure(log=log), or why it could not run (a missing tool: the report
    says so instead of a table)."""
    log(title)
    try:
        return measure(log=log)
    except RuntimeError as e:
        log(f"  not measured: {e}")
        return str(e)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few repetitions; results to a temp dir")
    parser.add_argument("--out", help="write BENCHMARKS.md, overhead.png and results.json here")
    args = parser.parse_args()

    started, load_start = time.time(), os.getloadavg()[0]
    # (Before anything is written: the revision's "uncommitted changes" are
    # then the user's, not this run's own report and plot.)
    info = report.machine_info(ROOT)
    # One intra-op thread: per-call overhead is what is measured, and a
    # two-thread matmul on a shared 2-core machine stalls whenever another
    # process holds a core, which swamps the medium body's figures.
    torch.set_num_threads(1)
    settings = overhead.QUICK if args.quick else overhead.FULL

    log("C++ benchmarks (build/bench)")
    cpp, cpp_error = None, None
    try:
        cpp = cpp_bench.run(quick=args.quick)
    except cpp_bench.CppBenchError as e:
        cpp_error = str(e)
        log(f"ERROR: {cpp_error}")

    log("Python per-call times")
    results = overhead.run(settings, log=log)

    log("Large module argument (python benchmarks/module_args.py runs only this)")
    module = module_args.run(quick=args.quick, log=log)

    log("Leaf-heavy model (python benchmarks/leaf_heavy.py runs only this)")
    heavy = leaf_heavy.run(quick=args.quick, log=log)

    log("Memory")
    memory = run_memory(args.quick)

    log("Seam, capture and replay (python benchmarks/capture_split.py runs only this)")
    split = capture_split.run(quick=args.quick, log=log)

    log("Calls per graph, and a leaf's structure built from custom_op (python benchmarks/structure.py runs only this)")
    structure_result = structure.run(quick=args.quick, log=log)

    if args.quick:
        counts = by_library = None  # minutes under valgrind and perf: full runs only
    else:
        counts = _tool_measurement("Instructions per call (callgrind)", instructions.run)
        by_library = _tool_measurement("Time per step by library (perf)", time_shares.by_library)

    targets = report.compute_targets(results, cpp, memory, counts)
    if args.out or args.quick:
        out_dir = args.out or tempfile.mkdtemp(prefix="torchleaf-bench-")
        os.makedirs(out_dir, exist_ok=True)
        md_path, plot_path = os.path.join(out_dir, "BENCHMARKS.md"), os.path.join(out_dir, "overhead.png")
        plot_name = "overhead.png"
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump({
                "python": report.results_as_json(results),
                "module": {f"{mode}/{impl}": t.as_dict() for (mode, impl), t in module.items()},
                "leaf_heavy": {
                    f"{n}/{mode}/{impl}": r if isinstance(r, str) else r.as_dict() for (n, mode, impl), r in heavy.items()
                },
                "cpp": cpp,
                "memory": memory,
                "instructions": counts,
                "time_by_library": by_library,
                "capture_split": split,
                "structure": structure_result,
            }, f, indent=1)
    else:
        md_path, plot_path = os.path.join(ROOT, "BENCHMARKS.md"), os.path.join(ROOT, "docs", "overhead.png")
        plot_name = "docs/overhead.png"

    report.plot(results, plot_path)
    settings_note = (
        f"rounds × batch per variant: small {settings.rounds['small']} × {settings.batch['small']}, "
        f"medium {settings.rounds['medium']} × {settings.batch['medium']}"
        + (" (**--quick: smoke run, figures not meaningful**)" if args.quick else "")
    )
    text = report.markdown(
        info=info,
        settings_note=settings_note,
        results=results,
        cpp=cpp,
        cpp_error=cpp_error,
        memory=memory,
        module=module,
        heavy=heavy,
        targets=targets,
        plot_name=plot_name,
        load=(load_start, os.getloadavg()[0]),
        elapsed_s=time.time() - started,
        instructions=counts,
        by_library=by_library,
        split=split,
        structure=structure_result,
    )
    with open(md_path, "w") as f:
        f.write(text)

    log("")
    for name, measured, verdict in targets:
        log(f"  {verdict:4}  {name}: {measured}")
    log(f"\nWrote {md_path} and {plot_path} in {time.time() - started:.0f} s")
    if cpp_error:
        log("\nFAILED: the C++ benchmark did not build or run (see above).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
