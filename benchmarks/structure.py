"""Two measurements that say which part of a compiled leaf call's overhead is
per call and which is the structure every leaf must have.

    python benchmarks/structure.py      # prints markdown tables

* **Calls per graph** -- the small body called 1, 2 and 4 times in a chain
  inside one compiled fwd+bwd step (``f(f(x))``...), for custom_op, the two
  structure variants below and torchleaf. The slope, (t4 - t1) / 3, is what
  one more call costs once the step already runs one; the rest of a
  variant's overhead is paid once per step.
* **A leaf's structure, built from custom_op** -- custom_op's overhead when it
  is given, one by one, what a leaf cannot do without: a backward that is an
  opaque operator (a leaf's body cannot be traced, so neither can its
  backward), and a handle from the forward to that operator (how the backward
  finds the graph its forward recorded without state hidden between calls).
  Neither variant records or replays anything; torchleaf does both. A
  third variant passes the handle as an int (a SymInt the compiled graph
  saves as a Python int) instead of a tensor: a measurement only, since an
  int cannot own what it names, so a graph dropped without its backward
  would leak the state a leaf's handle frees.
* **The order token's store** -- torchleaf traced without storing its last
  call's order token (a graph output Dynamo writes to a global after each
  step, so that no call is dead code whatever the use of its outputs). A
  measurement only: without the store, a call whose outputs the step does not
  use may be removed by the compiler.

Every variant is its own compiled function (its own code object: Dynamo caches
per code object), all timed interleaved in one process, one thread, small body
``x * 2 + 1`` on 64 floats.
"""

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from implementations import SMALL, build_custom_op, build_plain, build_torchleaf  # noqa: E402
from timing import time_interleaved  # noqa: E402
from torchleaf import _dynamo  # noqa: E402

BACKENDS = ("aot_eager", "inductor")
CALLS = (1, 2, 4)
CHAINED = (("plain", build_plain), ("custom_op", build_custom_op), ("torchleaf", build_torchleaf))
NAMESPACE = "torchleaf_structure"
OPAQUE = "custom_op, backward an opaque operator"
HANDLE = "custom_op, backward an opaque operator taking a handle from the forward"
INT_HANDLE = "custom_op, backward an opaque operator taking an int from the forward (owns nothing: measurement only)"
NO_STORE = "torchleaf, order token not stored (unsafe: measurement only)"
# The variants chained 1, 2 and 4 times, in the tables' order.
CHAINED_ROWS = ("custom_op", OPAQUE, HANDLE, "torchleaf")


@contextlib.contextmanager
def _order_token_not_stored():
    """While Dynamo traces in this block, compiled leaf calls do not store
    their order token (see _dynamo._order_decisions)."""
    decide = _dynamo._order_decisions
    _dynamo._order_decisions = lambda mutates: (decide(mutates)[0], False)
    try:
        yield
    finally:
        _dynamo._order_decisions = decide


def _opaque_backward_ops():
    """(forward op whose backward is an opaque operator, the same forward
    also returning a handle that its backward operator takes, the same with
    an int for a handle)."""

    @torch.library.custom_op(f"{NAMESPACE}::backward", mutates_args=())
    def backward(g: torch.Tensor) -> torch.Tensor:
        return g * 2

    backward.register_fake(torch.empty_like)

    @torch.library.custom_op(f"{NAMESPACE}::body", mutates_args=())
    def body(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    body.register_fake(torch.empty_like)
    body.register_autograd(lambda ctx, g: backward(g))

    @torch.library.custom_op(f"{NAMESPACE}::backward_with_handle", mutates_args=())
    def backward_with_handle(g: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        return g * 2

    backward_with_handle.register_fake(lambda g, handle: torch.empty_like(g))

    @torch.library.custom_op(f"{NAMESPACE}::body_with_handle", mutates_args=())
    def body_with_handle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2 + 1, torch.zeros((), dtype=torch.int64)

    body_with_handle.register_fake(lambda x: (torch.empty_like(x), x.new_empty((), dtype=torch.int64)))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[1])

    body_with_handle.register_autograd(
        lambda ctx, g, _: backward_with_handle(g, ctx.saved_tensors[0]), setup_context=setup_context
    )

    @torch.library.custom_op(f"{NAMESPACE}::backward_with_int", mutates_args=())
    def backward_with_int(g: torch.Tensor, handle: int) -> torch.Tensor:
        return g * 2

    backward_with_int.register_fake(lambda g, handle: torch.empty_like(g))

    @torch.library.custom_op(f"{NAMESPACE}::body_with_int", mutates_args=())
    def body_with_int(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x * 2 + 1, 0

    # (An unbacked int: the compiled graph gets it from the operator at run
    # time, and also asserts that it is >= 0, a size's range.)
    body_with_int.register_fake(lambda x: (torch.empty_like(x), torch.library.get_ctx().new_dynamic_size()))

    def setup_int(ctx, inputs, output):
        ctx.handle = output[1]

    body_with_int.register_autograd(lambda ctx, g, _: backward_with_int(g, ctx.handle), setup_context=setup_int)
    return body, lambda x: body_with_handle(x)[0], lambda x: body_with_int(x)[0]


def _chain(call, k, name):
    """``lambda x: call(call(...call(x))).sum()`` (k calls) with its own code
    object."""
    source = f"def {name}(x):\n    return {'call(' * k}x{')' * k}.sum()\n"
    scope = {"call": call}
    exec(compile(source, f"<{name}>", "exec"), scope)
    return scope[name]


def _steps(backend, opaque, with_handle, with_int):
    x = torch.randn(64, requires_grad=True)
    steps = {}
    variants = [(key, build(SMALL), CALLS) for key, build in CHAINED]
    variants += [(OPAQUE, opaque, CALLS), (HANDLE, with_handle, CALLS), (INT_HANDLE, with_int, (1,))]
    variants += [(NO_STORE, build_torchleaf(SMALL), (1,))]
    for n, (key, call, counts) in enumerate(variants):
        for k in counts:
            fn = torch.compile(_chain(call, k, f"step_{backend}_{n}_{k}"), backend=backend, fullgraph=True)
            steps[(key, k)] = lambda fn=fn: fn(x).backward()
            with _order_token_not_stored() if key == NO_STORE else contextlib.nullcontext():
                steps[(key, k)]()  # compiles
            for _ in range(2):  # warm the compiled code
                steps[(key, k)]()
    return steps


def run(quick=False, log=print):
    """{backend: {variant: {calls per graph: µs per step over plain code with
    as many calls}}}; the variant traced without the order token's store with
    one call only."""
    torch.set_num_threads(1)
    rounds, batch = (5, 10) if quick else (61, 50)
    structure_ops = _opaque_backward_ops()
    result = {}
    for backend in BACKENDS:
        torch._dynamo.reset()
        timings = time_interleaved(_steps(backend, *structure_ops), batch=batch, rounds=rounds)
        result[backend] = {}
        for (key, k), t in timings.items():
            if key != "plain":
                plain = timings[("plain", k)].median_us
                result[backend].setdefault(key, {})[k] = t.median_us - plain
        row = result[backend]
        log(f"  {backend}: one call custom_op +{row['custom_op'][1]:.1f}, torchleaf +{row['torchleaf'][1]:.1f}, "
            f"opaque backward +{row[OPAQUE][1]:.1f}, with handle +{row[HANDLE][1]:.1f}, "
            f"with an int handle +{row[INT_HANDLE][1]:.1f}, "
            f"token not stored +{row[NO_STORE][1]:.1f} µs")
    return result


def once(row):
    """The overhead paid once per step whatever the calls: t1 - slope."""
    return row[CALLS[0]] - slope(row)


def slope(row):
    """The overhead of one more call in the step: (t4 - t1) / 3."""
    return (row[CALLS[-1]] - row[CALLS[0]]) / (CALLS[-1] - CALLS[0])


def markdown(result):
    out = [
        "| backend | implementation | 1 call | 2 calls | 4 calls | each call after the first | paid once per step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for backend, rows in result.items():
        for key in CHAINED_ROWS:
            row = rows[key]
            out.append(
                f"| {backend} | {key} | {row[1]:+.1f} | {row[2]:+.1f} | {row[4]:+.1f} | "
                f"{slope(row):+.1f} | {once(row):+.1f} |"
            )
    out += [
        "",
        "| backend | implementation | overhead, one call (µs) | over custom_op |",
        "|---|---|---:|---:|",
    ]
    for backend, rows in result.items():
        base = rows["custom_op"][1]
        for key in ("custom_op", OPAQUE, HANDLE, INT_HANDLE, "torchleaf", NO_STORE):
            out.append(f"| {backend} | {key} | {rows[key][1]:+.1f} | {rows[key][1] - base:+.1f} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(run(quick="--quick" in sys.argv, log=lambda msg: None))))
