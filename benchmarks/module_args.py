"""Per-call time of a leaf that takes a large nn.Module argument.

    python benchmarks/module_args.py            # prints a markdown table
    python benchmarks/module_args.py --quick    # few repetitions

The module is ``nn.Sequential`` of 200 ``nn.Linear(8, 8)`` (400 parameters);
the body runs it on x: 4x8 float32. Variants: the module called inline
(plain) and through a torchleaf leaf, eager forward (parameters require
grad, the graph is recorded), eager fwd+bwd, and compile(aot_eager) fwd+bwd.
What the leaf adds per call is the cost of passing the module: its
parameters become operator inputs, and the real function runs with them
swapped in.
"""

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchleaf  # noqa: E402
from timing import time_interleaved  # noqa: E402

LAYERS = 200
DESCRIPTION = f"`nn.Sequential` of {LAYERS} `nn.Linear(8, 8)` ({2 * LAYERS} parameters) on x: 4x8 float32"
MODES = (
    ("eager_fwd", "eager fwd"),
    ("eager_fwdbwd", "eager fwd+bwd"),
    ("aot_eager_fwdbwd", "compile(aot_eager) fwd+bwd"),
)


def run_model(model, x):
    return model(x)


def model_and_variants():
    """(model, x, {"plain": inline call, "torchleaf": leaf}), each variant
    called as f(model, x). (instructions.py counts the eager forward.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS)])
    x = torch.randn(4, 8)
    leaf = torchleaf.leaf_function(run_model)
    leaf.register_fake(lambda model, x: x.new_empty(x.shape[0], 8))
    return model, x, {"plain": run_model, "torchleaf": leaf}


def run(quick=False, log=print):
    """{(mode key, "plain" | "torchleaf"): Timing}"""
    model, x, variants = model_and_variants()
    params = list(model.parameters())
    reference = torch.autograd.grad(run_model(model, x).sum(), params)
    batch, rounds = (2, 3) if quick else (20, 31)
    results = {}
    for key, label in MODES:
        log(f"  large module / {label}")
        steps = {}
        for name, fn in variants.items():
            if key == "eager_fwd":
                steps[name] = lambda fn=fn: fn(model, x)
                continue
            loss = lambda model, x, fn=fn: fn(model, x).sum()  # noqa: E731
            if key == "aot_eager_fwdbwd":
                torch._dynamo.reset()
                loss = torch.compile(loss, backend="aot_eager", fullgraph=True)
            got = torch.autograd.grad(loss(model, x), params)
            if not all(torch.allclose(g, r, rtol=1e-4, atol=1e-5) for g, r in zip(got, reference)):
                raise AssertionError(f"large module, {name}, {label}: gradients disagree with plain code")
            model.zero_grad(set_to_none=True)
            steps[name] = lambda loss=loss: loss(model, x).backward()
        for name, t in time_interleaved(steps, batch=batch, rounds=rounds).items():
            results[(key, name)] = t
    return results


def markdown(results):
    lines = [
        "| implementation | " + " | ".join(label for _, label in MODES) + " |",
        "|---|" + "---:|" * len(MODES),
    ]
    for name, label in (("plain", "plain (inline)"), ("torchleaf", "torchleaf")):
        cells = []
        for key, _ in MODES:
            t = results.get((key, name))
            if t is None:
                cells.append("—")
            elif name == "plain":
                cells.append(f"{t.median_us:.0f}")
            else:
                cells.append(f"{t.median_us:.0f} ({t.median_us - results[(key, 'plain')].median_us:+.0f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few repetitions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run(args.quick)
    print(f"\n### large module: {DESCRIPTION}\n")
    print("\n".join(markdown(results)))


if __name__ == "__main__":
    main()
