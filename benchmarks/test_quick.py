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
