"""Instructions against time, per shared library, for the compiled step of
custom_op and of the leaf (aot_eager, small body).

    python benchmarks/time_shares.py          # needs valgrind and perf

Two steps that execute the same number of instructions can still take
different times if one spends its instructions where each costs more
cycles (C++ that chases pointers and allocates, against the Python
interpreter's hot loop). This VM has no hardware counters, so instead:
each library's share of a step's instructions (callgrind, as
instructions.py counts them) next to its share of the step's time (perf
cpu-clock samples of the same step in steady state, in its own process).
Shares do not move with the machine's load the way absolute times do.

From custom_op's two columns, each library's time per instruction relative
to the step's average; applied to the leaf's instruction shares, they
predict the leaf's step time relative to custom_op's, as far as where its
instructions run can make it differ. The last columns are the same samples
in µs per step (perf's sampling makes every step slower, so compare the
two variants' columns with each other, not with other tables).
"""

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import instructions  # noqa: E402

STAGES = ("step: custom_op", "step: torchleaf")
FREQUENCY = 10000  # perf samples per second of CPU time


def _library(path):
    name = os.path.basename(path.strip())
    if name.startswith("_C.cpython") and "torchleaf" in path:
        return "torchleaf _C"
    return name or "?"


def instruction_shares(stage, n):
    """{library: share of the stage's instructions}, from callgrind."""
    with tempfile.TemporaryDirectory() as keep:
        instructions._count(stage, n, keep)
        (out,) = [os.path.join(keep, f) for f in os.listdir(keep)]
        text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", out],
                              capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+.*\[(.*?)\]\s*$", line)
        if m:
            counts[_library(m.group(2))] += int(m.group(1).replace(",", ""))
    total = sum(counts.values())
    return {lib: c / total for lib, c in counts.items()}


def time_shares(stage, n):
    """({library: share of cpu-clock samples}, µs per step in all) while
    the stage runs n times, sampled at FREQUENCY Hz (a share times the
    second is that library's µs per step, perf's own cost included)."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, done, data = (os.path.join(tmp, f) for f in ("ready", "done", "perf.data"))
        child = subprocess.Popen([sys.executable, instructions.__file__, "--child", stage,
                                  "--n", str(n), "--ready", ready, "--done", done])
        while not os.path.exists(ready):
            if child.poll() is not None:
                raise RuntimeError(f"stage {stage!r} exited early")
            time.sleep(0.1)
        perf = subprocess.Popen(["perf", "record", "-q", "-F", str(FREQUENCY), "-e", "cpu-clock",
                                 "-p", str(child.pid), "-o", data],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(done):
            time.sleep(0.1)
        perf.send_signal(signal.SIGINT)
        perf.wait()
        child.wait()
        # -v: full paths, to tell torchleaf's _C from torch's.
        report = subprocess.run(["perf", "report", "-v", "-i", data, "--stdio", "--sort", "dso",
                                 "-F", "sample,dso"],
                                capture_output=True, text=True)
    samples = collections.Counter()
    for line in report.stdout.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)", line)
        if m and not line.lstrip().startswith("#"):
            samples[_library(m.group(2))] += int(m.group(1))
    total = sum(samples.values())
    if report.returncode != 0 or total == 0:
        raise RuntimeError(f"perf recorded no samples of {stage!r} ({report.stderr.strip()[-300:]})")
    return {lib: c / total for lib, c in samples.items()}, total / FREQUENCY / n * 1e6


def by_library(n=20000, log=print):
    """For `make bench`: {stage: {"step_us": µs per step, "libraries":
    {library: µs per step}}} for STAGES, from perf alone (no callgrind).
    Raises RuntimeError without perf or when it records nothing."""
    if shutil.which("perf") is None:
        raise RuntimeError("perf is not installed (apt-get install linux-perf)")
    out = {}
    for stage in STAGES:
        shares, step_us = time_shares(stage, n)
        out[stage] = {"step_us": step_us, "libraries": {lib: share * step_us for lib, share in shares.items()}}
        log(f"  {stage}: {step_us:.1f} µs per step under perf")
    return out


def main():
    for tool in ("valgrind", "perf", "callgrind_annotate"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    instr = {s: instruction_shares(s, 200) for s in STAGES}
    # The child sleeps 3 s before its loop (for callgrind_control); perf
    # samples only while it runs.
    sampled = {s: time_shares(s, 20000) for s in STAGES}
    times = {s: shares for s, (shares, _) in sampled.items()}
    step_us = {s: us for s, (_, us) in sampled.items()}
    libs = sorted({lib for s in STAGES for lib in instr[s]},
                  key=lambda lib: -max(instr[s].get(lib, 0) for s in STAGES))
    libs = [lib for lib in libs if max(instr[s].get(lib, 0) for s in STAGES) >= 0.002]
    print("| library | custom_op: instructions | custom_op: time | torchleaf: instructions | "
          "torchleaf: time | custom_op: µs per step | torchleaf: µs per step | difference |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for lib in libs:
        cells = [f"{100 * d[s].get(lib, 0):.1f}%" for s in STAGES for d in (instr, times)]
        us = [times[s].get(lib, 0) * step_us[s] for s in STAGES]
        cells += [f"{us[0]:.1f}", f"{us[1]:.1f}", f"{us[1] - us[0]:+.1f}"]
        print(f"| {lib} | " + " | ".join(cells) + " |")
    print(f"| all | | | | | {step_us[STAGES[0]]:.1f} | {step_us[STAGES[1]]:.1f} | "
          f"{step_us[STAGES[1]] - step_us[STAGES[0]]:+.1f} |")
    # Time per instruction of each library, relative to custom_op's average.
    base = {lib: times[STAGES[0]].get(lib, 0) / share
            for lib, share in instr[STAGES[0]].items() if share > 0}
    own = {lib: times[STAGES[1]].get(lib, 0) / share
           for lib, share in instr[STAGES[1]].items() if share > 0}
    predicted = sum(share * base.get(lib, own.get(lib, 1.0))
                    for lib, share in instr[STAGES[1]].items())
    print(f"\nPredicted leaf step time / custom_op step time at equal instruction counts: "
          f"{predicted:.3f} (libraries custom_op does not load are weighted by their own "
          f"time per instruction in the leaf's step)")


if __name__ == "__main__":
    main()
