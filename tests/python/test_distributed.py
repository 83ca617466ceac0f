"""Leaf functions in distributed training: a model whose leaf calls one of
its submodules, trained by 2 gloo processes on 127.0.0.1 with
DistributedDataParallel (eager and torch.compile'd, where DDPOptimizer splits
the graph) and with FSDP2 (``fully_shard``, where the leaf receives
parameters that FSDP all-gathers), gives the gradients, losses and updated
parameters of one process trained on the whole batch, with the leaf and with
the undecorated function.

Each test starts its two ranks as fresh subprocesses running
``_distributed_worker.py`` (which holds the model and the leaf, and does the
checking), waits for both with a time limit, and kills both on timeout or
when one fails. Nothing is compiled or initialised in the pytest process.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
# Per run, both ranks together (an inductor run takes ~35 s on 2 cores).
TIMEOUT_S = 240
OK = "torchleaf-distributed-ok"

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with the gloo backend",
    ),
    pytest.mark.slow,  # several processes: not in `make check`
]


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc):
    """Kill a rank and anything it started (each rank leads its own process
    group), and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _launch(mode, backend, tmp_path, port):
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    # Fresh compile caches, shared by the two ranks of this run only.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor-cache")
    # Two ranks on a small machine: no intra-op threads or compile workers.
    env["OMP_NUM_THREADS"] = "1"
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    procs, logs = [], []
    try:
        for rank in range(WORLD):
            log_path = tmp_path / f"{mode}-{backend}-port{port}-rank{rank}.log"
            logs.append(log_path)
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", "import _distributed_worker as w; w.main()",
                         mode, backend, str(rank), str(WORLD), str(port)],
                        cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        timed_out = False
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank failed: the other would wait for it in a collective
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            _kill(p)
    outputs = [log.read_text(errors="replace") for log in logs]
    return [p.returncode for p in procs], outputs, timed_out


def run_ranks(mode, backend, tmp_path):
    """Run both ranks of ``mode`` under ``backend``; fail with their output
    unless both finish in time and report success."""
    for attempt in range(2):
        returncodes, outputs, timed_out = _launch(mode, backend, tmp_path, _free_port())
        # The port was free when chosen; another process may take it before
        # rank 0 binds it. Retry once with a new one.
        if attempt == 0 and any("address already in use" in o.lower() for o in outputs):
            continue
        break
    ok = not timed_out and returncodes == [0] * WORLD and all(OK in o.splitlines() for o in outputs)
    if not ok:
        what = f"timed out after {TIMEOUT_S} s" if timed_out else f"exit codes {returncodes}"
        details = "\n".join(f"----- rank {r} (last lines) -----\n{o[-6000:]}" for r, o in enumerate(outputs))
        pytest.fail(f"{mode}/{backend}: {what}\n{details}", pytrace=False)
    for o in outputs:  # shown with -rA: subgraph counts, largest difference
        print([line for line in o.splitlines() if line.startswith("rank ")][-1])


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_ddp_matches_one_process(backend, tmp_path):
    """DDP over 2 ranks, each on half of every batch, for 3 SGD steps: every
    step's global loss, every parameter's (all-reduced) gradient and the
    updated parameters equal one process's on the whole batch, with the leaf
    and with the undecorated function; the real function runs once per step
    on each rank and both sides of its data-dependent branch run. Compiled
    (fullgraph=False, since DDP's own wrapper breaks the graph): Dynamo makes
    one graph of the model, DDPOptimizer splits it at DDP's 1 MiB buckets into
    3 subgraphs with the leaf in one whose output feeds the next, and nothing
    recompiles after the first step."""
    run_ranks("ddp", backend, tmp_path)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp2_root_sharded_matches_one_process(backend, tmp_path):
    """``fully_shard(model)`` only: the root's pre-forward all-gathers every
    parameter, so the leaf gets ``head`` with plain unsharded parameters.
    Gradients (reduce-scattered DTensors, compared as full tensors), losses
    and updated parameters equal one process's, with the leaf and without."""
    run_ranks("fsdp-root", backend, tmp_path)


def test_fsdp2_sharded_head_with_unshard_before_the_leaf(tmp_path):
    """``fully_shard(model.head); fully_shard(model)``: head's parameters stay
    sharded DTensors until head's own pre-forward hook, which runs only inside
    the leaf, so a plain call fails in torchleaf.forward ("got mixed
    torch.Tensor and DTensor"; worker mode "fsdp-head" reproduces it). Made to
    work from user code with FSDP2's public API: the model calls
    ``self.head.unshard()`` before the leaf, and head is sharded with
    ``reshard_after_forward=False`` so that the post-forward hook that runs
    inside the leaf does not swap the parameters back to sharded ones (which
    torchleaf reports as the leaf replacing them). Eager only: compiled calls
    refuse such a module (next test). Same checks as above."""
    run_ranks("fsdp-head-unshard", "eager", tmp_path)


@pytest.mark.parametrize(
    "mode, backend, says",
    [
        # head's own pre-forward hook, which gathers its parameters, would
        # run inside the leaf, too late (DTensor's own error did not say what
        # to shard instead).
        ("fsdp-head", "eager", "argument whose 'weight' is a sharded DTensor"),
        # Compiled, the workaround above left head's parameters without a
        # gradient, silently: FSDP's hooks for head's own parameters do not
        # see the leaf's use of them.
        ("fsdp-head-unshard", "aot_eager", "argument that fully_shard was applied to, in a compiled call"),
    ],
    ids=["eager", "compiled_after_unshard"],
)
def test_fsdp2_separately_sharded_module_argument_is_a_clear_error(mode, backend, says, tmp_path):
    """fully_shard(model.head); fully_shard(model): torchleaf names the leaf
    and says what to shard instead."""
    returncodes, outputs, timed_out = _launch(mode, backend, tmp_path, _free_port())
    assert not timed_out
    assert returncodes != [0] * WORLD
    for o in outputs:
        assert "LeafFunctionError" in o and says in o, o[-3000:]
        assert "Shard only a parent of the module (fully_shard(model))" in o
