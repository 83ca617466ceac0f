"""Interleaved per-call timing: the median of batch means.

All variants of one comparison are timed in the same process, round-robin:
each round runs one batch of every variant, so slow drifts (frequency
scaling, a noisy neighbour) hit all of them alike. A batch is ``batch``
back-to-back calls timed with ``time.perf_counter_ns``; the figure reported
for a variant is the median over rounds of its batch means.

Each round visits the variants in a new order (seeded, so runs repeat). In a
fixed order a variant always follows the same neighbour and inherits what
that one left warm: the compiled leaf step timed right after another leaf
variant ran 2-4 µs faster than the same step in another position, enough to
invent or hide a difference of that size.
"""

import gc
import random
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_us: float
    p25_us: float
    p75_us: float
    rounds: int
    batch: int

    def as_dict(self):
        return self.__dict__.copy()


def _run_batch(step, batch):
    start = time.perf_counter_ns()
    for _ in range(batch):
        step()
    return (time.perf_counter_ns() - start) / batch


def time_interleaved(steps, *, batch, rounds, warmup_batches=1, seed=0):
    """Per-call times of ``steps`` ({name: zero-argument callable})."""
    for _ in range(warmup_batches):
        for step in steps.values():
            _run_batch(step, batch)
    means = {name: [] for name in steps}
    order = list(steps)
    rng = random.Random(seed)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                means[name].append(_run_batch(steps[name], batch))
    finally:
        if gc_was_enabled:
            gc.enable()
    timings = {}
    for name, values in means.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        timings[name] = Timing(
            median_us=statistics.median(values) / 1e3,
            p25_us=q[0] / 1e3,
            p75_us=q[2] / 1e3,
            rounds=rounds,
            batch=batch,
        )
    return timings
