"""
torch.func and per-sample gradients
===================================

Leaves work under ``torch.func``: ``vmap`` (by default a loop over the
samples, or a batching rule of your own), ``grad``, ``vjp``, ``jacrev``, and
their compositions, such as per-sample gradients with ``vmap(grad(f))``.
Forward-mode AD (``jvp``, ``jacfwd``, ``hessian``) and second derivatives
under ``torch.func`` are clear errors.
"""

import textwrap

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import torchleaf

torch.manual_seed(0)


@torchleaf.leaf_function
def robust(x, w):
    y = x @ w
    # Python control flow on the data, per call:
    return y.clamp(-1, 1) if y.abs().max() > 3 else y


@robust.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[-1])


x = torch.randn(5, 3)
w = torch.randn(3, 2)

# %%
# ``vmap``: a per-sample loop by default
# --------------------------------------
# Without a rule of its own the leaf runs once per sample and the outputs
# are stacked; the result equals the batched call row by row.

per_sample = vmap(robust, in_dims=(0, None))(x, w)
print(per_sample.shape, torch.allclose(per_sample, torch.stack([robust(r, w) for r in x])))

# %%
# A batching rule of your own
# ---------------------------
# ``register_vmap`` takes a rule with ``torch.library.register_vmap``'s
# convention: it gets ``info`` (``info.batch_size``), the batch dimension of
# each argument, the batched arguments, and returns ``(outputs, out_dims)``.
# Here the body is batch-friendly already, so the rule calls it once.

calls = []


@torchleaf.leaf_function
def scaled_sum(x, w):
    calls.append(x.shape)
    return (x * w).sum(-1)


@scaled_sum.register_fake
def _(x, w):
    return x.new_empty(x.shape[:-1])


@scaled_sum.register_vmap
def _(info, in_dims, x, w):
    x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
    return scaled_sum(x, w), 0


out = vmap(scaled_sum, in_dims=(0, None))(x, w[:, 0])
print(out.shape, "calls of the body:", len(calls), "with shape", calls[-1])

# %%
# ``grad`` and ``jacrev``
# -----------------------

g = grad(lambda w: robust(x, w).pow(2).sum())(w)
w_ = w.clone().requires_grad_()
(expected,) = torch.autograd.grad(robust(x, w_).pow(2).sum(), w_)
print("grad matches autograd:", torch.allclose(g, expected))
print("jacobian shape:", jacrev(robust, argnums=1)(x[0], w).shape)

# %%
# Per-sample gradients
# --------------------
# The classic recipe: ``functional_call`` makes the model a function of its
# parameters, ``grad`` differentiates one sample's loss, ``vmap`` maps it over
# the batch. The leaf takes the module's head as an argument.


@torchleaf.leaf_function
def head_logits(h, head):
    return head(h)


@head_logits.register_fake
def _(h, head):
    return h.new_empty(*h.shape[:-1], head.out_features)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return head_logits(self.body(x).tanh(), self.head)


net = Net()
params = {k: v.detach() for k, v in net.named_parameters()}
targets = torch.randint(0, 4, (5,))


def sample_loss(params, x, y):
    logits = functional_call(net, params, (x.unsqueeze(0),))
    return nn.functional.cross_entropy(logits, y.unsqueeze(0))


per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, targets)
for name, g in per_sample_grads.items():
    print(f"{name:12s} {tuple(g.shape)}")

# Check one sample against plain autograd:
net.zero_grad()
nn.functional.cross_entropy(net(x[:1]), targets[:1]).backward()
print("sample 0 matches:", torch.allclose(per_sample_grads["head.weight"][0], net.head.weight.grad, atol=1e-6))

# %%
# Forward mode is a clear error
# -----------------------------
# A leaf's backward is a replay of the graph its body recorded; there is no
# forward-mode rule, and torchleaf refuses a tangent rather than drop it.

try:
    torch.func.jvp(lambda w: robust(x, w), (w,), (torch.ones_like(w),))
except torchleaf.LeafFunctionError as e:
    print(textwrap.fill(str(e), 88))
