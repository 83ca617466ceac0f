"""
Writing a leaf in C++
=====================

A C++ leaf is a pair of functions from a list of tensors to a list of
tensors: the real one, which may do anything, and a fake one, which computes
only output metadata (it runs on meta or fake tensors). ``define_leaf``
registers them as the operator ``namespace::name``. C++ code calls it with
autograd and no Python at all; Python code calls it through ``torch.ops``
after ``torchleaf.load_library``, eagerly, compiled, exported, or in an
AOTInductor package.
"""

# %%
# The C++ side
# ------------
# ``examples/cpp`` is a complete downstream project. Its CMake file finds the
# installed torchleaf (the wheel ships its headers, library and CMake package):
#
# .. literalinclude:: ../../examples/cpp/CMakeLists.txt
#    :language: cmake
#    :caption: examples/cpp/CMakeLists.txt
#
# Its program defines a leaf with data-dependent control flow, calls it and
# differentiates through it, in C++ only:
#
# .. literalinclude:: ../../examples/cpp/main.cpp
#    :language: cpp
#    :caption: examples/cpp/main.cpp
#
# :doc:`../api/cpp` lists the whole C++ API: ``define_leaf``,
# ``LeafOptions`` (declared arity, mutated inputs, per-leaf checks),
# ``find_leaf``, ``Config`` and ``LeafError``.
#
# A library of leaves
# -------------------
# To use C++ leaves from Python, define them in a shared library; defining
# happens when the library is loaded (static initializers). This library is
# the one torchleaf's own tests load:
#
# .. literalinclude:: ../../tests/cpp/leaf_test_library.cpp
#    :language: cpp
#    :caption: tests/cpp/leaf_test_library.cpp
#    :lines: 1-43
#
# The Python side
# ---------------
# ``make build`` builds that library as
# ``build/py/tests/cpp/libtorchleaf_testleaves.so``.

import glob
import os

import torch

import torchleaf


def find_library():
    """The test library in build/py of the checkout this torchleaf came from
    (or of TORCHLEAF_BUILD_DIR)."""
    here = os.path.dirname(os.path.abspath(torchleaf.__file__))
    roots = [os.environ.get("TORCHLEAF_BUILD_DIR", "")]
    while here != os.path.dirname(here):
        roots.append(os.path.join(here, "build", "py"))
        here = os.path.dirname(here)
    for build in roots:
        found = glob.glob(os.path.join(build, "tests", "cpp", "libtorchleaf_testleaves.so"))
        if found:
            return found[0]
    raise FileNotFoundError("libtorchleaf_testleaves.so: run `make build` first")


# %%
# ``torchleaf.load_library`` loads it (like ``torch.ops.load_library``) and
# registers the leaves' fakes with PyTorch's tracers. The leaves are then
# operators under ``torch.ops.torchleaf_test``, taking and returning lists of
# tensors.

torchleaf.load_library(find_library())
scale_bias = torch.ops.torchleaf_test.scale_bias
positives = torch.ops.torchleaf_test.positives

x = torch.randn(5, requires_grad=True)
b = torch.randn(5)
(y,) = scale_bias([x, b])
y.sum().backward()
print("y     =", y.detach())
print("dy/dx =", x.grad)

# %%
# In a traced graph each C++ leaf is its own named operator, one node. The
# fake of ``positives`` gives an unbacked size (``nonzero()`` under fake
# tensors), so its output's length is symbolic.


def f(x, b):
    (p,) = positives([x])
    (y,) = scale_bias([x, b])
    return y.sum() + p.sum()


from torch.fx.experimental.proxy_tensor import make_fx

gm = make_fx(f, tracing_mode="symbolic")(x.detach(), b)
print(gm.code.strip())

# %%
# And compiled with ``fullgraph=True``, with gradients:

compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
x1 = x.detach().clone().requires_grad_()
x2 = x.detach().clone().requires_grad_()
(g1,) = torch.autograd.grad(compiled(x1, b), x1)
(g2,) = torch.autograd.grad(f(x2, b), x2)
print("compiled gradient == eager gradient:", torch.allclose(g1, g2))
