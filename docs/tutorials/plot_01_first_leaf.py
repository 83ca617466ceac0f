"""
Your first leaf function
========================

A *leaf function* is Python code that ``torch.compile``, ``make_fx``,
AOTAutograd, Inductor and ``torch.export`` must not trace into. torchleaf
makes it **one opaque operator** in every graph, **runs it for real** on every
call (with whatever Python it contains), and makes it **differentiable
without a hand-written backward**: each call records its own autograd graph,
which backward replays.

This tutorial writes one, calls it eagerly, compiles a function that calls it
with ``fullgraph=True``, checks the gradients and looks at the graph.
"""

import torch

import torchleaf

torch.manual_seed(0)

# %%
# Decorate a function
# -------------------
# The body below branches on a value of the data and prints: code a tracing
# compiler would either bake in (wrong on the next call) or stop at (a graph
# break). As a leaf it stays Python.


@torchleaf.leaf_function
def rescale(x, w):
    y = x @ w
    peak = y.abs().max()
    if peak > 4:  # data-dependent control flow: fine in a leaf
        print(f"  rescale: peak {peak.item():.2f} > 4, dividing")
        y = y * (4 / peak)
    return y.tanh()


# %%
# Tracers never run the body: they run a *fake* that says what the outputs
# look like (shape, dtype, device) from the inputs. ``register_fake`` returns
# the leaf, so the fake can reuse the name ``_``.


@rescale.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


# %%
# Call it eagerly
# ---------------
# An eager call needs no fake. Gradients flow to every input that requires
# grad, through the graph the body itself recorded.

x = torch.randn(4, 3)
w = torch.randn(3, 2, requires_grad=True)
out = rescale(x * 3, w)
out.sum().backward()
print("output shape:", tuple(out.shape))
print("w.grad:\n", w.grad)

# %%
# Compile with ``fullgraph=True``
# -------------------------------
# ``fullgraph=True`` makes a graph break an error, so this proves the leaf is
# a single operator inside one graph. The body still runs on every call: the
# print appears whenever the data says so.


def loss_fn(x, w):
    return (rescale(x, w) ** 2).mean()


compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)

for scale in (1.0, 5.0):
    x = torch.randn(4, 3) * scale
    w1 = torch.randn(3, 2, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    eager_loss, compiled_loss = loss_fn(x, w1), compiled(x, w2)
    eager_loss.backward()
    compiled_loss.backward()
    print(f"scale {scale}: loss eager {eager_loss.item():.5f} compiled {compiled_loss.item():.5f}, "
          f"max grad diff {(w1.grad - w2.grad).abs().max().item():.1e}")

# %%
# What the compiler sees
# ----------------------
# A backend is a function that receives Dynamo's FX graph. This one prints
# the graph and runs it as it is: the leaf is one node, ``torchleaf.call``
# (PyTorch's own operators around it stay visible to the compiler).


def show_graph(gm, example_inputs):
    print(gm.code.strip())
    return gm.forward


torch.compile(loss_fn, backend=show_graph, fullgraph=True)(x, w1)

# %%
# ``make_fx`` traces down to ATen operators, which is what AOTAutograd and
# Inductor receive. Traced through a whole training step (loss and gradient),
# the leaf is two opaque calls: ``torchleaf.forward`` runs the body and keeps
# its autograd graph, ``torchleaf.backward`` replays that graph; the handle
# between them (``getitem_2``) names the call's captured state. Everything
# else is PyTorch's own operators, which the compilers optimize as usual.

from torch.fx.experimental.proxy_tensor import make_fx


def train_step(x, w):
    loss = loss_fn(x, w)
    return loss, torch.autograd.grad(loss, w)[0]


gm = make_fx(train_step)(torch.randn(4, 3), torch.randn(3, 2, requires_grad=True))
print(gm.code.strip())

# %%
# The same graph as a picture: one box per operator call, the leaf's two in
# orange.

import matplotlib.pyplot as plt

nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]
fig, ax = plt.subplots(figsize=(6, 0.5 * len(nodes) + 0.5))
for i, node in enumerate(nodes):
    leaf = "torchleaf" in str(node.target)
    y = len(nodes) - i
    ax.text(0.5, y, str(node.target).replace(".default", ""), ha="center", va="center", fontsize=10,
            bbox=dict(boxstyle="round", fc="#f5a142" if leaf else "#dde6f0", ec="#555"))
    if i:
        ax.annotate("", xy=(0.5, y + 0.3), xytext=(0.5, y + 0.7), arrowprops=dict(arrowstyle="->", color="#555"))
ax.set_xlim(0, 1)
ax.set_ylim(0.4, len(nodes) + 0.6)
ax.axis("off")
ax.set_title("make_fx graph of a training step")
plt.tight_layout()

# %%
# What to take away
# -----------------
# * ``@torchleaf.leaf_function`` plus ``@f.register_fake`` is all a leaf needs.
# * Eager calls, ``torch.compile`` (any backend) and backward give the same
#   values and gradients as the undecorated function.
# * The next tutorials cover fakes for dynamic shapes, modules as arguments,
#   mutation, ``torch.func``, distributed training, export and C++ leaves.
