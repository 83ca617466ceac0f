"""Build and run the C++ Google Benchmark suite (benchmarks/cpp).

It gets its own CMake build directory (build/bench) configured without the
Python extension and the tests. A failed build or run raises: run.py reports
it and exits nonzero.
"""

import json
import os
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_DIR = os.path.join(ROOT, "build", "bench")
EXECUTABLE = os.path.join(BUILD_DIR, "benchmarks", "cpp", "torchleaf_bench")


class CppBenchError(RuntimeError):
    pass


def _run(cmd, what):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        raise CppBenchError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


def build():
    _run(
        [
            "cmake", "-S", ROOT, "-B", BUILD_DIR, "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            "-DTORCHLEAF_BUILD_PYTHON=OFF",
            "-DTORCHLEAF_BUILD_TESTS=OFF",
            "-DTORCHLEAF_BUILD_BENCHMARKS=ON",
        ],
        "configuring the C++ benchmarks",
    )
    _run(["cmake", "--build", BUILD_DIR, "--target", "torchleaf_bench"], "building the C++ benchmarks")
    return EXECUTABLE


def run(quick):
    """{benchmark name: {"time_us", "cpu_us", "live_states"}} plus the JSON context."""
    executable = build()
    args = [executable, "--benchmark_format=json"]
    if quick:
        args.append("--benchmark_min_time=0.01")
    else:
        args += [
            "--benchmark_min_time=0.2",
            "--benchmark_repetitions=9",
            "--benchmark_enable_random_interleaving=true",
            "--benchmark_report_aggregates_only=true",
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise CppBenchError(f"torchleaf_bench failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout)
    results = {}
    for b in report["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[b["time_unit"]]
        results[name] = {
            "time_us": b["real_time"] * scale,
            "cpu_us": b["cpu_time"] * scale,
            "live_states": b.get("live_states"),
        }
    return {"results": results, "context": report["context"]}
