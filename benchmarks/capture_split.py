"""What a compiled leaf call costs without its capture, with it, and with its
replay: the small body's compiled step in three forms, against custom_op's.

    python benchmarks/capture_split.py      # prints a markdown table

* **forward, no grad** -- the input does not require grad: neither custom_op
  nor the leaf records anything. The leaf's cost is its seam alone (operator
  entry, Python runner, output description).
* **forward, grad** -- the input requires grad and the outputs are dropped
  without backward: the leaf also records its body's autograd graph, makes
  its state and handle and frees them; custom_op runs setup_context.
* **forward + backward** -- the step of the other benchmarks: the leaf
  replays the recorded graph, custom_op runs its hand-written backward
  (under Inductor, compiled into the backward graph's kernel).

Each form of each variant is its own compiled function, timed interleaved
with all the others in one process (timing.time_interleaved), one thread.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from implementations import SMALL, build_custom_op, build_plain, build_torchleaf, make_loss  # noqa: E402
from timing import time_interleaved  # noqa: E402

BACKENDS = ("aot_eager", "inductor")
FORMS = ("forward, no grad", "forward, grad", "forward + backward")
VARIANTS = (("plain", build_plain), ("custom_op", build_custom_op), ("torchleaf", build_torchleaf))


def _steps(backend):
    steps = {}
    for key, build in VARIANTS:
        call = build(SMALL)
        for form in FORMS:
            tag = form.replace(" ", "").replace(",", "_").replace("+", "_")
            fn = torch.compile(make_loss(call, f"loss_{key}_{backend}_{tag}"), backend=backend, fullgraph=True)
            x = torch.randn(64, requires_grad=form != "forward, no grad")
            if form == "forward + backward":
                steps[(form, key)] = lambda fn=fn, x=x: fn(x).backward()
            else:
                steps[(form, key)] = lambda fn=fn, x=x: fn(x)
            for _ in range(3):  # compile, and warm the compiled code
                steps[(form, key)]()
    return steps


def run(quick=False, log=print):
    """{backend: {form: {"custom_op": µs, "torchleaf": µs}}}: overheads over
    plain code in the same form (median of interleaved batch means)."""
    torch.set_num_threads(1)
    rounds, batch = (5, 10) if quick else (101, 50)
    result = {}
    for backend in BACKENDS:
        torch._dynamo.reset()
        timings = time_interleaved(_steps(backend), batch=batch, rounds=rounds)
        result[backend] = {}
        for form in FORMS:
            plain = timings[(form, "plain")].median_us
            result[backend][form] = {
                key: timings[(form, key)].median_us - plain for key, _ in VARIANTS if key != "plain"
            }
            log(f"  {backend} {form}: custom_op +{result[backend][form]['custom_op']:.1f}, "
                f"torchleaf +{result[backend][form]['torchleaf']:.1f} µs")
    return result


def markdown(split):
    out = [
        "| backend | step | custom_op overhead (µs) | torchleaf overhead (µs) | torchleaf − custom_op |",
        "|---|---|---:|---:|---:|",
    ]
    for backend, forms in split.items():
        for form in FORMS:
            c, t = forms[form]["custom_op"], forms[form]["torchleaf"]
            out.append(f"| {backend} | {form} | {c:+.1f} | {t:+.1f} | {t - c:+.1f} |")
    out.append("")
    for backend, forms in split.items():
        seam, grad, step = ((forms[f]["torchleaf"] - forms[f]["custom_op"]) for f in FORMS)
        out.append(
            f"- {backend}: the seam {seam:+.1f} µs, the capture {grad - seam:+.1f} µs, "
            f"the replay {step - grad:+.1f} µs against custom_op's counterparts."
        )
    return out


if __name__ == "__main__":
    print("\n".join(markdown(run(log=lambda msg: None))))
