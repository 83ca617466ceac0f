"""The committed type stubs (python/torchleaf/_C.pyi) list exactly the
bindings the extension defines, each of which is documented."""

import ast
import os

import torchleaf
from torchleaf import _C


def test_stubs_match_the_bindings():
    path = os.path.join(os.path.dirname(torchleaf.__file__), "_C.pyi")
    with open(path) as f:
        tree = ast.parse(f.read())
    stubbed = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    bound = {name for name in dir(_C) if not name.startswith("__")}
    assert stubbed == bound
    for name in bound:
        obj = getattr(_C, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"_C.{name} has no docstring"
