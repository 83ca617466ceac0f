"""
Leaves that take modules
========================

A leaf can take ``nn.Module`` arguments. Their parameters and buffers become
inputs of the call, so gradients reach them, and a compiled graph reaches the
module at run time through a small handle: the graph does not depend on
*which* module it was traced with. Ten layers that pass their own submodule
to one leaf compile to one frame.
"""

import torch
from torch import nn

import torchleaf

torch.manual_seed(0)

# %%
# A gate that runs a module
# -------------------------


@torchleaf.leaf_function
def gate(h, head):
    scores = head(h)
    if scores.abs().max() > 10:  # data-dependent: fine
        print("large scores")
    return scores.softmax(-1)


@gate.register_fake
def _(h, head):
    return h.new_empty(h.shape[0], head.out_features)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, width)

    def forward(self, h):
        return self.proj(h).relu() * gate(h, self.head)


model = nn.Sequential(*[Block(8) for _ in range(10)])
x = torch.randn(4, 8)

# %%
# Eager and compiled agree, gradients included
# ---------------------------------------------
# The head's weights get gradients although the compiler never saw the body
# that uses them.

compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
eager_out, compiled_out = model(x), compiled(x)
eager_grads = torch.autograd.grad(eager_out.sum(), list(model.parameters()))
compiled_grads = torch.autograd.grad(compiled_out.sum(), list(model.parameters()))
print("max output diff:", (eager_out - compiled_out).abs().max().item())
print("max grad diff:  ", max((a - b).abs().max().item() for a, b in zip(eager_grads, compiled_grads)))
names = [n for n, _ in model.named_parameters()]
heads = [g for n, g in zip(names, compiled_grads) if n.endswith("head.weight")]
print(f"head weights with a nonzero gradient: {sum(bool(g.abs().sum() > 0) for g in heads)} of {len(heads)}")

# %%
# One graph for every module of one structure
# --------------------------------------------
# Count the frames Dynamo compiles for a function that calls each layer's
# block separately: the ten heads are ten modules of the same structure, so
# they share one compiled frame.

from torch._dynamo.testing import CompileCounter

torch._dynamo.reset()
counter = CompileCounter()
block_fn = torch.compile(lambda block, h: block(h), backend=counter, fullgraph=True)
for block in model:
    block_fn(block, x)
print("frames compiled for 10 blocks:", counter.frame_count)

# %%
# Module attributes are read at run time
# --------------------------------------
# The real function reads modules as they are when it runs. Changing a
# weight between calls needs no recompilation: the compiled call sees it.

lin = nn.Linear(8, 8)
f = torch.compile(lambda h: gate(h, lin), backend="aot_eager", fullgraph=True)
before = f(x)
with torch.no_grad():
    lin.weight.mul_(0)
    lin.bias.zero_()
after = f(x)
print("rows sum to 1:", after.sum(-1))
print("uniform after zeroing the weights:", torch.allclose(after, torch.full_like(after, 1 / 8)))

# %%
# Methods and plain classes
# -------------------------
# ``@leaf_function`` also decorates methods; ``self`` is then an argument like
# any other (a module's parameters become inputs).


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    @torchleaf.leaf_function
    def score(self, h):
        return self.lin(h).squeeze(-1).sigmoid()

    @score.register_fake
    def _(self, h):
        return h.new_empty(h.shape[0])


scorer = Scorer()
print(torch.compile(lambda h: scorer.score(h), backend="aot_eager", fullgraph=True)(x))
