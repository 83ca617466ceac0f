"""Smoke test: the quick benchmark run exercises every implementation and
mode without crashing, and writes its report outside the repository."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_quick_benchmark_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "run.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,  # the first run also builds the C++ suite in build/bench
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = (tmp_path / "BENCHMARKS.md").read_text()
    torchleaf_rows = [line for line in table.splitlines() if line.startswith("| torchleaf |")]
    assert len(torchleaf_rows) == 3, table  # small and medium bodies, large module
    assert "### large module:" in table
    for row in torchleaf_rows:
        assert "not supported" not in row, row
    assert "| torchleaf leaf |" in table  # C++ and memory rows
    assert (tmp_path / "overhead.png").stat().st_size > 0
    assert (tmp_path / "results.json").exists()


def test_instruction_section_derives_the_leafs_extra_costs():
    """BENCHMARKS.md's instruction section (full runs only, under valgrind):
    steps over plain code per backend, and the replay and recording costs
    derived from the stage counts."""
    sys.path.insert(0, HERE)
    import report

    counts = {
        "step: plain": 600.0, "step: custom_op": 650.0, "step: torchleaf": 652.5,
        "inductor step: plain": 480.0, "inductor step: custom_op": 590.0, "inductor step: torchleaf": 640.0,
        "forward op": 90.0, "custom_op op": 104.0, "forward+backward ops": 120.5,
        "body": 43.5, "body recording autograd": 51.5,
    }
    text = "\n".join(report.instructions_markdown(counts))
    assert "| plain | 600.0 | — | 480.0 | — |" in text
    assert "| torchleaf | 652.5 | +52.5 | 640.0 | +160.0 |" in text
    assert "minus forward) | 30.5 |" in text  # the backward operator: 120.5 - 90.0
    assert "minus the above) | 8.0 |" in text  # recording: 51.5 - 43.5
    missing = report.instructions_markdown("valgrind is not installed (apt-get install valgrind)")
    assert "Not counted: valgrind is not installed (apt-get install valgrind)" in missing


def test_targets_compare_instruction_counts_when_counted():
    """The small-body targets are also judged in instructions per step (which
    the machine's load does not move), from the same run's counts; without
    counts (--quick, or no valgrind) there are no such rows."""
    sys.path.insert(0, HERE)
    import report

    counts = {"step: custom_op": 651.0, "step: torchleaf": 648.5,
              "inductor step: custom_op": 597.2, "inductor step: torchleaf": 634.0}
    rows = {name: (measured, verdict) for name, measured, verdict in report.compute_targets({}, {}, {}, counts)
            if "instructions" in name}
    assert len(rows) == 2, rows
    aot, inductor = (rows[n] for n in sorted(rows))  # "aot_eager" < "inductor"
    assert aot == ("648.5k vs 651.0k (-2.5k)", "PASS")
    assert inductor == ("634.0k vs 597.2k (+36.8k)", "MISS")
    for missing in (None, "valgrind is not installed (apt-get install valgrind)"):
        assert not [t for t in report.compute_targets({}, {}, {}, missing) if "instructions" in t[0]]
