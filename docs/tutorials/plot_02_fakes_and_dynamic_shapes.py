"""
Fakes and dynamic shapes
========================

Tracers (``torch.compile``, ``make_fx``, ``torch.export``) never run a leaf's
body: they run its *fake*, a function with the same signature that returns
outputs of the right structure, shapes, dtypes and devices, computed from the
inputs' metadata alone. This tutorial shows fakes for sizes that follow the
inputs, for sizes that depend on the data, and for int outputs, and what
happens when a fake is wrong.
"""

import textwrap

import torch

import torchleaf

torch.manual_seed(0)

# %%
# Sizes that follow the inputs
# ----------------------------
# Write the fake with ``new_empty`` / ``empty_like`` and the inputs' sizes.
# Under ``dynamic=True`` those sizes are symbolic, so one graph serves every
# batch size.


@torchleaf.leaf_function
def pairwise(x, y):
    return torch.cdist(x, y)


@pairwise.register_fake
def _(x, y):
    return x.new_empty(x.shape[0], y.shape[0])


compiled = torch.compile(lambda x, y: pairwise(x, y).sum(), backend="aot_eager", fullgraph=True, dynamic=True)
for n in (3, 5, 8):
    print(n, compiled(torch.randn(n, 2), torch.randn(4, 2)).item())

# %%
# Sizes that depend on the data
# -----------------------------
# ``x[x > 0]`` has as many elements as ``x`` has positive entries: nothing in
# the input's metadata says how many. The fake asks the tracer for a new
# symbolic size with ``torch.library.get_ctx().new_dynamic_size()`` (an
# *unbacked* size); each call then returns its own count, without
# recompiling.


@torchleaf.leaf_function
def positives(x):
    return x[x > 0] * 2


@positives.register_fake
def _(x):
    n = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(n)


def total(x):
    p = positives(x)
    return p.sum(), p.shape[0]


compiled_total = torch.compile(total, backend="aot_eager", fullgraph=True)
for _ in range(3):
    x = torch.randn(8, requires_grad=True)
    s, count = compiled_total(x)
    (g,) = torch.autograd.grad(s, x)
    print(f"{count} positive entries, sum {s.item():.3f}, gradient {g.tolist()}")

# %%
# Int outputs
# -----------
# A leaf may return ints. An int that changes between calls needs a fake
# that returns a symbolic int: an expression of the inputs' sizes
# (``x.shape[0]``) or, for a count only the data knows, ``new_dynamic_size()``.
# A plain int in the fake would be a constant of the graph.


@torchleaf.leaf_function
def count_large(x, threshold):
    n = int((x.abs() > threshold).sum())
    return x.clamp(-threshold, threshold), n


@count_large.register_fake
def _(x, threshold):
    return torch.empty_like(x), torch.library.get_ctx().new_dynamic_size()


f = torch.compile(lambda x: count_large(x, 1.0), backend="aot_eager", fullgraph=True)
for _ in range(3):
    y, n = f(torch.randn(16))
    print("entries clamped:", n, type(n).__name__)

# %%
# A wrong fake is a clear error
# -----------------------------
# A compiled graph is built from the fake's outputs, so a fake that disagrees
# with the body would make compiled code compute garbage. torchleaf checks
# every traced call's real outputs against what the fake said (rank, sizes,
# dtype, device) and raises :class:`torchleaf.LeafFunctionError` naming the
# leaf.


@torchleaf.leaf_function
def flatten_rows(x):
    return x.reshape(-1)


@flatten_rows.register_fake
def _(x):
    return x.new_empty(x.shape[0])  # wrong: should be x.numel()


try:
    torch.compile(flatten_rows, backend="aot_eager", fullgraph=True)(torch.randn(2, 3))
except torchleaf.LeafFunctionError as e:
    print(textwrap.fill(str(e), 88))

# %%
# ``torchleaf.config.validate_outputs`` goes further: it runs the fake next to
# every call, eager ones included, and compares structure, shape, dtype and
# device. Use it while writing a fake.

with torchleaf.config.patch(validate_outputs=True):
    try:
        flatten_rows(torch.randn(2, 3))
    except torchleaf.LeafFunctionError as e:
        print(textwrap.fill(str(e), 88))
