"""
Export and AOTInductor
======================

``torch.export`` records a program as a graph another process can load and
run. A leaf in such a graph must be an operator that process can find by
name, so a Python leaf exports when it is given one:
``@leaf_function(name="mylib::clip")`` is also the operator
``torch.ops.mylib.clip``. A process that loads the program imports the module
that defines the leaf first. C++ leaves are named operators from the start,
and also run in AOTInductor packages, from Python or from a C++ program with
no Python at all (``examples/aoti``).
"""

import io
import json
import re

import textwrap

import torch
from torch import nn

import torchleaf

torch.manual_seed(0)

# %%
# A named leaf
# ------------


@torchleaf.leaf_function(name="tutorial::clip_rows")
def clip_rows(x, max_norm: float = 1.0):
    norms = x.norm(dim=1, keepdim=True)
    if norms.max() <= max_norm:  # data-dependent: export could not trace this
        return x * 1
    return x * (max_norm / norms).clamp(max=1.0)


@clip_rows.register_fake
def _(x, max_norm: float = 1.0):
    return torch.empty_like(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return clip_rows(self.lin(x), 2.0).relu()


net = Net().eval()
x = torch.randn(3, 4) * 5

# %%
# Export it
# ---------
# The exported graph has the leaf as one node that calls its own named
# operator, ``torch.ops.tutorial.clip_rows``; a dynamic batch dimension stays
# symbolic.

batch = torch.export.Dim("batch")
ep = torch.export.export(net, (x,), dynamic_shapes=({0: batch},))
# (The node's last argument describes the call as JSON; shortened here.)
print(re.sub(r"'\{\"torchleaf\"[^']*'", "'{...}'", ep.graph_module.code.strip()))

# %%
# The leaf's node records the call: which leaf, the module a loading process
# must import (here the tutorial's own script), and how its arguments
# travel. ``check_output_sizes`` checks, when the program runs, that the
# real output has the sizes the fake promised.

for node in ep.graph.nodes:
    if node.op == "call_function" and "tutorial" in str(node.target):
        call = json.loads(node.args[1])
        print(node.target, "on", [a.name for a in node.args[0]])
        print("  leaf:", call["leaf"], "| import:", call["import"], "| arguments:", call["args"])

# %%
# Run, save and load
# ------------------
# The exported module runs the real function, with any batch size. Saving
# and loading is ``torch.export.save``/``load``; in another process, import
# the module that defines ``clip_rows`` before loading.

for n in (2, 6):
    xi = torch.randn(n, 4) * 5
    print(n, torch.allclose(ep.module()(xi), net(xi)))

buf = io.BytesIO()
torch.export.save(ep, buf)
buf.seek(0)
loaded = torch.export.load(buf)
print("loaded program agrees:", torch.allclose(loaded.module()(x), net(x)))

# %%
# An unnamed leaf cannot be exported
# ----------------------------------
# Its operator would be known to this process only. The error says what to
# do.


@torchleaf.leaf_function
def unnamed(x):
    return x * 2


@unnamed.register_fake
def _(x):
    return torch.empty_like(x)


class Uses(nn.Module):
    def forward(self, x):
        return unnamed(x)


try:
    torch.export.export(Uses(), (x,))
except Exception as e:  # export wraps torchleaf's error
    while e.__cause__ is not None and not isinstance(e, torchleaf.LeafFunctionError):
        e = e.__cause__
    print(type(e).__name__ + ":", textwrap.fill(str(e), 88))

# %%
# AOTInductor, from Python and from C++
# -------------------------------------
# AOTInductor compiles an exported program into a package (``.pt2``) with
# generated C++; compiling one takes minutes on a small CPU, so this page
# shows the code of ``examples/aoti`` instead of running it (``make test``
# runs it: ``tests/python/test_aoti.py``). The leaf there is a C++ leaf,
# defined when its library is loaded:
#
# .. literalinclude:: ../../examples/aoti/leaves.cpp
#    :language: cpp
#    :caption: examples/aoti/leaves.cpp
#
# Python loads that library, exports a model that calls the leaf and
# compiles the package:
#
# .. literalinclude:: ../../examples/aoti/package.py
#    :language: python
#    :pyobject: package
#    :caption: examples/aoti/package.py
#
# A C++ program, with no Python in it, links the library (which defines the
# leaf), loads the package and runs it:
#
# .. literalinclude:: ../../examples/aoti/main.cpp
#    :language: cpp
#    :caption: examples/aoti/main.cpp
#
# Build and run it with:
#
# .. code-block:: sh
#
#    prefix=$(python -c 'import torch, torchleaf; print(torch.utils.cmake_prefix_path + ";" + torchleaf.cmake_prefix_path)')
#    cmake -S examples/aoti -B build/aoti -G Ninja -DCMAKE_PREFIX_PATH="$prefix"
#    cmake --build build/aoti
#    mkdir -p build/aoti/out
#    python examples/aoti/package.py build/aoti/libaoti_example_leaves.so build/aoti/out
#    build/aoti/aoti_example build/aoti/out/model.pt2 build/aoti/out/cases.pt
