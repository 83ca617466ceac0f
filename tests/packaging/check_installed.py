"""Uses torchleaf as installed from its wheel into a fresh venv (run by
wheel_test.sh with the venv's Python, `-I`, from an empty folder): the copy
imported is the venv's, and a Python leaf works eagerly and compiled."""

import os
import sys

import torch

import torchleaf

venv = os.path.realpath(sys.prefix)


def check(ok, message):
    if not ok:
        raise SystemExit(f"FAILED: {message}")


def inside_venv(path):
    return os.path.realpath(path).startswith(venv + os.sep)


check(sys.prefix != sys.base_prefix, f"{sys.executable} is not a venv's Python")
for module in (torch, torchleaf, torchleaf._C):
    check(inside_venv(module.__file__), f"{module.__name__} imported from {module.__file__}, not from {venv}")
# The torch of the building Python (wheel_test.sh installs that release).
expected = os.environ["TORCHLEAF_EXPECTED_TORCH"]
check(torch.__version__.split("+")[0] == expected, f"torch {torch.__version__}, expected {expected}")
check(torchleaf._C.BUILT_TORCH_VERSION == expected, f"built against torch {torchleaf._C.BUILT_TORCH_VERSION}")
config = os.path.join(torchleaf.cmake_prefix_path, "torchleaf", "torchleafConfig.cmake")
check(inside_venv(config) and os.path.isfile(config), f"no CMake package at {config}")

calls = []


def plain(x, w):
    y = x @ w
    if y.abs().max() > 2.0:  # data-dependent: a tracer must not bake it in
        y = y.tanh()
    return y.sin()


@torchleaf.leaf_function
def layer(x, w):
    calls.append(1)
    return plain(x, w)


@layer.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def loss(fn, x, w):
    return fn(x, w).pow(2).sum()


compiled = torch.compile(lambda x, w: loss(layer, x, w), backend="aot_eager", fullgraph=True)

torch.manual_seed(0)
w = torch.randn(3, 4, requires_grad=True)
for scale, branch in ((0.1, "small"), (10.0, "large")):  # both sides of the branch
    x = (torch.randn(5, 3) * scale).requires_grad_(True)
    expected = torch.autograd.grad(loss(plain, x, w), (x, w))
    for name, run in (("eager", lambda: loss(layer, x, w)), ("aot_eager", lambda: compiled(x, w))):
        before = len(calls)
        value = run()
        check(len(calls) == before + 1, f"{name}/{branch}: the leaf ran {len(calls) - before} times, not once")
        check(torch.allclose(value, loss(plain, x, w)), f"{name}/{branch}: value differs from the plain function")
        grads = torch.autograd.grad(value, (x, w))
        for g, e, arg in zip(grads, expected, "xw"):
            check(torch.allclose(g, e), f"{name}/{branch}: gradient of {arg} differs from the plain function")
check(torchleaf.live_states() == 0, f"{torchleaf.live_states()} autograd states leaked")

print(f"torchleaf {torchleaf.__file__}: leaf eager and under aot_eager, values and gradients match")
print(f"cmake_prefix_path {torchleaf.cmake_prefix_path}")
