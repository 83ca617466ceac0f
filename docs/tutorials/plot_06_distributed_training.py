"""
Training with DDP, FSDP2 and activation checkpointing
=====================================================

A leaf is an ordinary autograd citizen, so the training stack works around
it: ``DistributedDataParallel`` and FSDP2's ``fully_shard`` (eager and
compiled), activation checkpointing, saved-tensor hooks, autocast. This
tutorial trains a small model whose ``head`` is passed to a leaf, first under
DDP, then under FSDP2, then with the leaf inside a checkpointed block, and
compares every loss with a plain single-process run.

To stay short and run anywhere it uses one process (world size 1) on the
CPU ``gloo`` backend; the same code runs unchanged under ``torchrun`` with
more ranks (``tests/python/test_distributed.py`` checks two ranks against
single-process references).
"""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchleaf

torch.manual_seed(0)


calls = []


@torchleaf.leaf_function
def gate(h, head):
    calls.append(h.shape[0])  # how often the body really runs
    scores = head(h)
    rows = []
    for row in scores:  # a Python branch per row, on the data
        rows.append(row.softmax(-1) if row.mean() > 0 else torch.sigmoid(row) * 0.5)
    return torch.stack(rows)


@gate.register_fake
def _(h, head):
    return h.new_empty(h.shape[0], head.out_features)


class Net(nn.Module):
    def __init__(self, use_checkpoint=False):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 32)
        self.out = nn.Linear(32, 1)
        self.use_checkpoint = use_checkpoint

    def block(self, x):
        return gate(self.trunk(x), self.head)

    def forward(self, x):
        if self.use_checkpoint:
            g = checkpoint(self.block, x, use_reentrant=False)
        else:
            g = self.block(x)
        return self.out(g)


data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]


def train(model, steps=len(data)):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data[:steps]:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 6))
    return losses


reference_model = Net()
reference = train(copy.deepcopy(reference_model))
print("plain, one process:", reference)

# %%
# A process group
# ---------------
# One rank of ``gloo`` on the local machine; ``torchrun`` would set these
# variables for every rank.

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
dist.init_process_group("gloo", rank=0, world_size=1)

# %%
# DistributedDataParallel, compiled
# ---------------------------------
# DDP's gradient hooks see the head's parameters because the leaf's call
# takes the head as an argument: its parameters are inputs of the call.

from torch.nn.parallel import DistributedDataParallel

ddp = DistributedDataParallel(copy.deepcopy(reference_model))
ddp_compiled = torch.compile(ddp, backend="aot_eager")
print("DDP, compiled:     ", train(ddp_compiled))

# %%
# FSDP2
# -----
# ``fully_shard(model)`` gathers every parameter before the forward, so the
# leaf sees whole tensors. (Sharding the module that is passed to the leaf on
# its own, ``fully_shard(model.head)``, is a clear error: see
# :doc:`../guides/troubleshooting`.)

from torch.distributed.fsdp import fully_shard

fsdp_model = copy.deepcopy(reference_model)
fully_shard(fsdp_model)
print("FSDP2, eager:      ", train(fsdp_model))

# %%
# Activation checkpointing
# ------------------------
# Under checkpointing the leaf's body runs twice per step: in the forward
# and again in the recomputation of backward, exactly as the undecorated
# function would.

ckpt_model = Net(use_checkpoint=True)
ckpt_model.load_state_dict(reference_model.state_dict())
calls.clear()
print("checkpointed, compiled:", train(torch.compile(ckpt_model, backend="aot_eager", fullgraph=True)))
print("the body ran", len(calls), "times in", len(data), "steps")

dist.destroy_process_group()
