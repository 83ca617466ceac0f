"""Exports a model that calls the C++ leaf aoti_example::clip_rows and
compiles it with AOTInductor (see README.md).

    python examples/aoti/package.py LIBRARY OUTDIR

LIBRARY is the built libaoti_example_leaves.so; OUTDIR receives model.pt2
(the AOTInductor package), exported.pt2 (the torch.export program) and
cases.pt (inputs and eager outputs, for the C++ program to compare with).
"""

import os
import sys

import torch
from torch import nn

import torchleaf


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        # Two calls of the leaf (each returns a Tensor[] of two tensors).
        clipped, norms = torch.ops.aoti_example.clip_rows([self.lin(x)])
        again, norms2 = torch.ops.aoti_example.clip_rows([clipped * 3])
        return again.relu(), norms + norms2


def example_inputs():
    """Two batch sizes; rows of small and of large norm."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g) * 0.1, torch.randn(5, 4, generator=g) * 10]


def package(library, outdir):
    """Loads the leaf library, exports Net with a dynamic batch size, writes
    model.pt2, exported.pt2 and cases.pt to outdir; returns (net, inputs,
    eager outputs)."""
    torchleaf.load_library(library)
    torch.manual_seed(0)
    net = Net().eval()
    inputs = example_inputs()
    with torch.no_grad():
        expected = [list(net(x)) for x in inputs]
    batch = torch.export.Dim("batch")
    ep = torch.export.export(net, (inputs[0],), dynamic_shapes=({0: batch},))
    torch.export.save(ep, os.path.join(outdir, "exported.pt2"))
    torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(outdir, "model.pt2"))
    cases = [{"inputs": [x], "expected": e} for x, e in zip(inputs, expected)]
    torch.save(cases, os.path.join(outdir, "cases.pt"))
    return net, inputs, expected


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    _, inputs, expected = package(sys.argv[1], sys.argv[2])
    compiled = torch._inductor.aoti_load_package(os.path.join(sys.argv[2], "model.pt2"))
    for x, e in zip(inputs, expected):
        torch.testing.assert_close(compiled(x), e)
    print(f"wrote {sys.argv[2]}/model.pt2; its outputs equal eager's from Python")
