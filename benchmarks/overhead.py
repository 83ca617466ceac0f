"""Per-call time of every implementation, body and mode (Python side).

Modes: eager forward, eager forward+backward, and torch.compile forward+
backward with the aot_eager and inductor backends. "Forward" runs with the
inputs requiring grad (the training forward, autograd graph recorded);
"forward+backward" runs ``impl(*inputs).sum()`` then ``.backward()`` (inputs'
``.grad`` accumulates, the same for every implementation). Compiled modes
compile that whole loss with fullgraph=True, except the graph-break variant,
which cannot be full-graph by construction.

Before timing, each variant's loss and input gradients are checked against
the plain implementation, so that nothing wrong gets timed.
"""

import traceback
from dataclasses import dataclass

import torch

from implementations import BODIES, IMPLEMENTATIONS, make_loss
from timing import time_interleaved


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    backend: str | None  # None: eager
    backward: bool


MODES = (
    Mode("eager_fwd", "eager fwd", None, False),
    Mode("eager_fwdbwd", "eager fwd+bwd", None, True),
    Mode("aot_eager_fwdbwd", "compile(aot_eager) fwd+bwd", "aot_eager", True),
    Mode("inductor_fwdbwd", "compile(inductor) fwd+bwd", "inductor", True),
)


@dataclass(frozen=True)
class Settings:
    batch: dict  # body name -> calls per batch
    rounds: dict  # body name -> batches per variant


FULL = Settings(batch={"small": 100, "medium": 4}, rounds={"small": 101, "medium": 41})
QUICK = Settings(batch={"small": 5, "medium": 1}, rounds={"small": 3, "medium": 3})


@dataclass(frozen=True)
class Unsupported:
    error: str  # exception class
    reason: str  # one line


def describe_failure(exc):
    """Exception class plus a one-line reason: the root cause's message, or
    where it was raised when it has none (a bare assert)."""
    root = exc
    while True:
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None and not root.__suppress_context__:
            inner = root.__context__
        if inner is None:
            break
        root = inner
    message = str(root).strip().splitlines()
    reason = message[0] if message and message[0] else ""
    if not reason:
        frame = traceback.extract_tb(root.__traceback__)[-1]
        path = frame.filename.split("site-packages/")[-1]
        reason = f"`{frame.line}` failed at {path}:{frame.lineno}"
        tb = root.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        target = tb.tb_frame.f_locals.get("target")
        value = tb.tb_frame.f_locals.get("value")
        if isinstance(target, str) and value is not None:
            reason += f" (graph constant `{target}` is a {type(value).__name__})"
    name = type(exc).__name__
    if root is not exc:
        name += f" ({type(root).__name__})"
    return Unsupported(error=name, reason=f"{reason[:200]}")


def _check(body, loss, inputs, reference):
    """Compare loss value and input gradients with the plain reference."""
    value = loss(*inputs)
    grads = torch.autograd.grad(value, inputs)
    ref_value, ref_grads = reference
    tol = dict(rtol=1e-4, atol=1e-3)
    ok = torch.allclose(value, ref_value, **tol) and all(
        torch.allclose(g, r, **tol) for g, r in zip(grads, ref_grads)
    )
    if not ok:
        raise AssertionError(f"{body.name}: {loss.__name__} disagrees with the plain implementation")


def _steps_for_mode(body, mode, calls, inputs, reference, log):
    """(steps to time, unsupported variants) for one body and mode."""
    steps, unsupported = {}, {}
    for impl in IMPLEMENTATIONS:
        if impl.compiled_only and mode.backend is None:
            continue
        call = calls[impl.key]
        loss = make_loss(call, f"{body.name}_{impl.key}_{mode.key}_loss")
        if mode.backend is not None:
            loss = torch.compile(loss, backend=mode.backend, fullgraph=impl.key != "graph_break")
        try:
            _check(body, loss, inputs, reference)
        except Exception as exc:  # recorded as "not supported", never hidden
            if impl.key != "builtin_leaf":
                raise  # only the built-in leaf_function is allowed to fail
            unsupported[impl.key] = describe_failure(exc)
            log(f"    {impl.key}: not supported ({unsupported[impl.key].error})")
            continue
        if mode.backward:
            steps[impl.key] = lambda loss=loss: loss(*inputs).backward()
        else:
            steps[impl.key] = lambda call=call: call(*inputs)
    return steps, unsupported


def run(settings, log=print):
    """{(body, mode, impl): Timing | Unsupported}"""
    torch.manual_seed(0)
    results = {}
    for body in BODIES:
        calls = {impl.key: impl.build(body) for impl in IMPLEMENTATIONS}
        inputs = body.make_inputs()
        plain_value = body.fn(*inputs).sum()
        reference = (plain_value.detach(), torch.autograd.grad(plain_value, inputs))
        for mode in MODES:
            log(f"  {body.name} / {mode.label}")
            steps, unsupported = _steps_for_mode(body, mode, calls, inputs, reference, log)
            timings = time_interleaved(
                steps, batch=settings.batch[body.name], rounds=settings.rounds[body.name]
            )
            for key, value in {**timings, **unsupported}.items():
                results[(body.name, mode.key, key)] = value
    return results
