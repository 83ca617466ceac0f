"""Named Python leaves for tests/python/test_export.py. A process that loads
a program exported from them imports this module (by name: tests/python on
sys.path), as a user's loader imports the module that defines their leaves."""

import torch
from torch import nn

import torchleaf

CALLS = {"gate": 0}


@torchleaf.leaf_function(name="torchleaf_export_test::gate")
def gate(x, w, scale=2.0, mode="tanh"):
    """Data-dependent control flow: a tracer must not bake either branch in."""
    CALLS["gate"] += 1
    y = x * w
    if mode == "tanh" and bool(y.sum() > 0):
        y = y.tanh()
    return {"out": y * scale, "norm": y.norm()}


@gate.register_fake
def _(x, w, scale=2.0, mode="tanh"):
    return {"out": torch.empty_like(x), "norm": x.new_empty(())}


@torchleaf.leaf_function(name="torchleaf_export_test::accumulate", mutates_args={"total"})
def accumulate(x, total):
    total.add_(x.detach().sum(0))
    return x * 2


@accumulate.register_fake
def _(x, total):
    return torch.empty_like(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        r = gate(self.lin(x), self.w, scale=3.0)
        return r["out"].relu() + r["norm"]


class Accumulating(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        return accumulate(x, self.total) + 1
