"""Helpers that read what torchleaf puts into the graphs PyTorch builds."""

import torch


def compiled_call_site(leaf, *inputs):
    """(leaf id, plan index) that Dynamo's graph of ``leaf(*inputs)`` passes
    to torchleaf::call: what compiled graphs call the operators with."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(lambda *xs: leaf(*xs), backend=backend, fullgraph=True)(*inputs)
    (node,) = [n for n in graphs[0].graph.nodes if n.target is torch.ops.torchleaf.call.default]
    return node.args[0], node.args[1]


def order_token():
    """An order token: compiled calls thread an empty int64 tensor."""
    return torch.empty(0, dtype=torch.int64)


def traced_call_site(leaf, *inputs):
    """(leaf id, plan index) that make_fx's graph of ``leaf(*inputs)`` passes
    to torchleaf::call: a traced call's, whose outputs carry no order token."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda *xs: leaf(*xs))(*inputs)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.torchleaf.call.default]
    return node.args[0], node.args[1]
