"""
Mutation and side effects
=========================

A leaf runs for real on every call, so its side effects (printing, logging,
appending to a Python list of your own, counting into a buffer) happen on
every call and in program order, eager and compiled. In-place changes of its
*inputs* must be declared with ``mutates_args``; an undeclared one is an
error, because a compiled graph would not know the tensor changed.
"""

import textwrap

import torch
from torch import nn

import torchleaf

torch.manual_seed(0)

# %%
# Declared mutation: ``mutates_args``
# -----------------------------------
# The leaf below counts its calls in a buffer it changes in place. Naming
# ``calls`` in ``mutates_args`` tells every tracer that the call writes it.


@torchleaf.leaf_function(mutates_args={"calls"})
def counted_relu(x, calls):
    calls.add_(1)
    return x.relu()


@counted_relu.register_fake
def _(x, calls):
    return torch.empty_like(x)


calls = torch.zeros((), dtype=torch.int64)
f = torch.compile(lambda x: counted_relu(x, calls) * 2, backend="aot_eager", fullgraph=True)
for _ in range(3):
    f(torch.randn(4))
counted_relu(torch.randn(4), calls)
print("calls counted (3 compiled + 1 eager):", calls.item())

# %%
# Modules named in ``mutates_args`` may change their buffers in place, such
# as BatchNorm's running statistics in training mode; eager and compiled
# statistics agree.


@torchleaf.leaf_function(mutates_args={"bn"})
def normalize(x, bn):
    return bn(x)


@normalize.register_fake
def _(x, bn):
    return torch.empty_like(x)


bn_eager, bn_compiled = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
step = torch.compile(lambda x: normalize(x, bn_compiled), backend="aot_eager", fullgraph=True)
for _ in range(3):
    x = torch.randn(8, 3)
    normalize(x, bn_eager)
    step(x)
print("running_mean eager   ", bn_eager.running_mean)
print("running_mean compiled", bn_compiled.running_mean)

# %%
# Undeclared mutation is an error
# -------------------------------


@torchleaf.leaf_function
def sneaky(x, buf):
    buf.mul_(2)  # not declared
    return x + 1


@sneaky.register_fake
def _(x, buf):
    return torch.empty_like(x)


try:
    sneaky(torch.randn(2), torch.ones(2))
except torchleaf.LeafFunctionError as e:
    print(textwrap.fill(str(e), 88))

# %%
# Side effects on your own objects
# --------------------------------
# The function gets its own copy of each list or dict it is passed, so
# appending to one would be lost (it is an error that says so). Pass an
# object of a class of your own instead: the function gets the object
# itself, so what it records persists. Compiled calls keep non-tensor
# arguments as graph constants, so the object must be hashable (plain
# objects are).


class Log:
    def __init__(self):
        self.lines = []


log = Log()


@torchleaf.leaf_function
def traced_norm(x, log):
    n = x.norm()
    log.lines.append(f"norm {n.item():.3f}")  # runs on every call, in order
    return x / n


@traced_norm.register_fake
def _(x, log):
    return torch.empty_like(x)


g = torch.compile(lambda x: traced_norm(x, log).sum(), backend="aot_eager", fullgraph=True)
for scale in (1, 10, 100):
    g(torch.ones(4) * scale)
print(log.lines)

try:
    history = []

    @torchleaf.leaf_function
    def appends(x, history):
        history.append(1)
        return x * 1

    appends(torch.ones(2), history)
except torchleaf.LeafFunctionError as e:
    print(textwrap.fill(str(e), 88))

# %%
# Gradients do not flow through in-place changes
# ----------------------------------------------
# A declared change computed from tensors that require grad would give the
# caller's buffer new data without its history: that is an error. Compute
# the new value out of place and return it instead.


@torchleaf.leaf_function(mutates_args={"acc"})
def accumulate(x, acc):
    acc.add_(x * 2)
    return x.sum()


@accumulate.register_fake
def _(x, acc):
    return x.new_empty(())


try:
    accumulate(torch.ones(3, requires_grad=True), torch.zeros(3))
except torchleaf.LeafFunctionError as e:
    print(textwrap.fill(str(e), 88))
