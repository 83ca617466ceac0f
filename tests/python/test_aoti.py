"""Deployment of a model that calls a C++ leaf with AOTInductor
(examples/aoti): the package runs from Python and from a C++ program with no
Python in it, with eager's outputs; the exported program round-trips through
torch.export.save/load in a fresh process. Each step is a subprocess with a
time limit; a failure shows its command and output."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import torchleaf

pytestmark = pytest.mark.slow  # C++ builds and subprocesses: not in `make check`

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXAMPLE = os.path.join(_ROOT, "examples", "aoti")


def _run(cmd, timeout):
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{' '.join(cmd)}` timed out after {timeout}s\n--- stdout\n{e.stdout}\n--- stderr\n{e.stderr}")
    if proc.returncode != 0:
        pytest.fail(
            f"`{' '.join(cmd)}` exited with {proc.returncode} after {time.monotonic() - start:.0f}s\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """examples/aoti built with CMake against the installed torchleaf, and
    its package built by examples/aoti/package.py."""
    build = tmp_path_factory.mktemp("aoti_build")
    out = tmp_path_factory.mktemp("aoti_out")
    prefix = torch.utils.cmake_prefix_path + ";" + torchleaf.cmake_prefix_path
    _run(["cmake", "-S", _EXAMPLE, "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          f"-DCMAKE_PREFIX_PATH={prefix}"], timeout=120)
    _run(["cmake", "--build", str(build)], timeout=300)
    library = str(build / "libaoti_example_leaves.so")
    _run([sys.executable, os.path.join(_EXAMPLE, "package.py"), library, str(out)], timeout=600)
    return SimpleNamespace(
        library=library,
        program=str(build / "aoti_example"),
        model=str(out / "model.pt2"),
        exported=str(out / "exported.pt2"),
        cases=str(out / "cases.pt"),
    )


def test_aoti_package_runs_from_python(deployed):
    torchleaf.load_library(deployed.library)
    compiled = torch._inductor.aoti_load_package(deployed.model)
    cases = torch.load(deployed.cases)
    assert [case["inputs"][0].shape[0] for case in cases] == [3, 5]  # the dynamic batch size
    for case in cases:
        torch.testing.assert_close(compiled(*case["inputs"]), case["expected"])


def test_aoti_package_runs_from_cpp_without_python(deployed):
    proc = _run([deployed.program, deployed.model, deployed.cases], timeout=120)
    assert proc.stdout.count("matches eager") == 2, proc.stdout


_ROUND_TRIP = """
import sys, torch, torchleaf
torchleaf.load_library(sys.argv[1])
ep = torch.export.load(sys.argv[2])
targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
assert targets.count("aoti_example.clip_rows.default") == 2, targets
for case in torch.load(sys.argv[3]):
    torch.testing.assert_close(list(ep.module()(*case["inputs"])), case["expected"])
print("round trip ok")
"""


def test_exported_program_round_trips_in_a_fresh_process(deployed):
    proc = _run([sys.executable, "-c", _ROUND_TRIP, deployed.library, deployed.exported, deployed.cases], timeout=300)
    assert "round trip ok" in proc.stdout
