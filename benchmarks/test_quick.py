"""Smoke test: the quick benchmark run exercises every implementation and
mode without crashing, and writes its report outside the repository."""

import os
import subprocess
import sys
import tempfile

import pytest

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
    # The leaf-heavy model's table: N = 10 and 100, three modes, torchleaf
    # measured (not failed) in each.
    heavy_rows = [line for line in table.splitlines() if line.startswith(("| 10 |", "| 100 |"))]
    assert len(heavy_rows) == 6, table
    for row in heavy_rows:
        assert row.split("|")[4].strip().endswith("×)"), row
    for row in torchleaf_rows:
        assert "not supported" not in row, row
    assert "| torchleaf leaf |" in table  # C++ and memory rows
    # The seam / capture / replay split, both backends, three forms each.
    split_rows = [line for line in table.splitlines() if line.startswith(("| aot_eager | forward", "| inductor | forward"))]
    assert len(split_rows) == 6, table
    assert "- inductor: the seam" in table
    # Calls per graph (custom_op and torchleaf, both backends) and the
    # structure rows, with the derived per-call and per-step figures.
    for backend in ("aot_eager", "inductor"):
        for impl in ("custom_op", "custom_op, backward an opaque operator taking a handle", "torchleaf"):
            assert any(line.startswith(f"| {backend} | {impl}") and line.count("|") == 8
                       for line in table.splitlines()), table
        assert f"- {backend}: each call after the first, torchleaf" in table
        assert f"| {backend} | torchleaf, order token not stored" in table
        assert f"| {backend} | custom_op, backward an opaque operator taking an int" in table
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


def test_inductor_gap_is_split_into_the_replays_parts_and_the_rest():
    """The Inductor step's difference from custom_op is split into what a
    replay is (the extra size asserts, the replayed nodes, the recording),
    from the parts counted in the step stages, and the rest; the target row
    reports both."""
    sys.path.insert(0, HERE)
    import report
    from instructions import part_key

    tl, co = "inductor step: torchleaf", "inductor step: custom_op"
    counts = {
        co: 594.0, tl: 634.0, "body": 44.0, "body recording autograd": 52.0,
        part_key(co, "size asserts"): 12.0, part_key(co, "size asserts", calls=True): 3.0,
        part_key(tl, "size asserts"): 24.5, part_key(tl, "size asserts", calls=True): 6.0,
        part_key(co, "replayed backward nodes"): 0.0, part_key(tl, "replayed backward nodes"): 13.0,
    }
    parts = report.inductor_step_parts(counts)
    assert parts["structural"] == 12.5 + 13.0 + 8.0
    assert parts["rest"] == 40.0 - 33.5
    text = "\n".join(report.instructions_markdown({**counts, "step: plain": 600.0}))
    assert "| Inductor's size asserts | 12.0 (3 calls) | 24.5 (6 calls) | +12.5 |" in text
    assert "| everything else | 582.0 | 588.5 | +6.5 |" in text
    rows = [m for name, m, _ in report.compute_targets({}, {}, {}, counts) if "inductor" in name and "instr" in name]
    assert rows == ["634.0k vs 594.0k (+40.0k); 33.5k of it is the replay's structure, +6.5k the rest "
                    "(see \"Where the compiled overhead goes\")"]
    # Parts counted as zero: the symbols were not found; said, not split.
    found_nothing = {**counts, part_key(tl, "replayed backward nodes"): 0.0}
    assert "not split: callgrind found no" in report.inductor_step_parts(found_nothing)
    text = "\n".join(report.instructions_markdown(found_nothing))
    assert "not split" in text and "everything else" not in text
    # Without the parts (an older run's counts), no split and no table.
    del counts[part_key(tl, "size asserts")]
    assert report.inductor_step_parts(counts) is None
    assert "everything else" not in "\n".join(report.instructions_markdown(counts))


def test_parts_are_read_from_callgrinds_caller_tree(tmp_path, monkeypatch):
    """instructions._parts sums a part's inclusive cost and its calls (from
    the caller lines above it) in callgrind_annotate's caller tree."""
    sys.path.insert(0, HERE)
    import instructions

    annotated = """
    4,000 ( 1.00%)  < ???:caller_a (600x) [libx.so]
      900 ( 0.10%)  < ???:caller_b (600x) [libx.so]
    4,900 ( 1.10%)  *  ???:torch::dynamo::(anonymous namespace)::assert_size_stride(_object*, _object*) [/lib/libtorch_python.so]

    2,600 ( 0.60%)  < ???:torchleaf::replay(x) (400x) [libtorchleaf.so]
    2,600 ( 0.60%)  *  ???:torch::autograd::generated::MulBackward0::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&) [/lib/libtorch_cpu.so]

      100 ( 0.01%)  < ???:x (200x) [libx.so]
      100 ( 0.01%)  *  ???:torch::autograd::generated::MulBackward0::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)'2 [/lib/libtorch_cpu.so]
"""

    class Done:
        stdout = annotated

    monkeypatch.setattr(instructions.subprocess, "run", lambda *a, **k: Done())
    parts = instructions._parts("out", 200)
    assert parts == {"size asserts": (4900 / 200 / 1e3, 6.0), "replayed backward nodes": (2600 / 200 / 1e3, 2.0)}


def test_callgrind_children_get_a_private_inductor_cache(monkeypatch):
    """Inductor code generated under Valgrind (no AVX-512) must not reach
    the shared cache, whose FX graph key does not include the vector ISA:
    native processes would run its 8-wide loops compiled 16-wide."""
    sys.path.insert(0, HERE)
    import instructions

    seen = {}

    class Stop(Exception):
        pass

    def popen(args, env=None, **kwargs):
        seen["env"] = env
        raise Stop

    monkeypatch.setattr(instructions.subprocess, "Popen", popen)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/shared/cache")
    with pytest.raises(Stop):
        instructions._count("step: torchleaf", 1)
    cache = seen["env"]["TORCHINDUCTOR_CACHE_DIR"]
    assert cache != "/shared/cache" and cache.startswith(tempfile.gettempdir())


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


def test_time_by_library_section_compares_the_two_steps(monkeypatch):
    """perf's samples per library become µs per step, libraries not shown
    apart are summed, and a run without perf says why."""
    sys.path.insert(0, HERE)
    import report
    import time_shares

    def fake_shares(stage, n):
        if stage == "step: custom_op":
            return {"libpython3.11.so.1.0": 0.5, "libtorch_cpu.so": 0.25, "libfoo.so": 0.25}, 200.0
        return {"libpython3.11.so.1.0": 0.4, "libtorch_cpu.so": 0.3, "libtorchleaf.so": 0.1,
                "libfoo.so": 0.1, "libbar.so": 0.1}, 250.0

    monkeypatch.setattr(time_shares.shutil, "which", lambda tool: "/usr/bin/" + tool)
    monkeypatch.setattr(time_shares, "time_shares", fake_shares)
    data = time_shares.by_library(log=lambda msg: None)
    assert data["step: torchleaf"]["libraries"]["libtorchleaf.so"] == pytest.approx(25.0)
    rows = {line.split(" | ")[0][2:]: line for line in report.time_by_library_markdown(data) if line.startswith("| ")}
    assert rows["the Python interpreter"] == "| the Python interpreter | 100.0 | 100.0 | +0.0 |"
    assert rows["libtorch_cpu (operators, autograd)"] == "| libtorch_cpu (operators, autograd) | 50.0 | 75.0 | +25.0 |"
    assert rows["libtorchleaf"] == "| libtorchleaf | 0.0 | 25.0 | +25.0 |"
    assert rows["everything else"] == "| everything else | 50.0 | 50.0 | +0.0 |"
    assert rows["the whole step"] == "| the whole step | 200.0 | 250.0 | +50.0 |"
    monkeypatch.setattr(time_shares.shutil, "which", lambda tool: None)
    with pytest.raises(RuntimeError, match="perf is not installed"):
        time_shares.by_library(log=lambda msg: None)
    assert "Not measured: perf is not installed" in "\n".join(report.time_by_library_markdown("perf is not installed"))
