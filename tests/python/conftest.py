import glob
import os

import pytest
import torch
import torch._dynamo

import torchleaf

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(items):
    """A test run with backend "inductor" is slow (an Inductor compile):
    marked so by its parameter, as other slow tests are by their marker."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v == "inductor" for v in params.values()):
            item.add_marker(pytest.mark.slow)


def _test_library_path():
    build = os.environ.get("TORCHLEAF_BUILD_DIR", os.path.join(_ROOT, "build", "py"))
    matches = glob.glob(os.path.join(build, "tests", "cpp", "libtorchleaf_testleaves.so"))
    if not matches:
        raise RuntimeError(f"C++ test leaves not built under {build}; run `make build`")
    return matches[0]


@pytest.fixture(scope="session")
def cpp_leaves():
    """torch.ops.torchleaf_test, C++ leaves from tests/cpp/leaf_test_library.cpp."""
    path = _test_library_path()
    torchleaf.load_library(path)
    import ctypes

    lib = ctypes.CDLL(path)
    lib.torchleaf_test_set_scale.argtypes = [ctypes.c_double]
    return torch.ops.torchleaf_test, lib


@pytest.fixture(autouse=True)
def _isolation():
    """Each test starts with fresh Dynamo caches and must not leak state."""
    torch._dynamo.reset()
    before = torchleaf.live_states()
    yield
    import gc

    gc.collect()
    assert torchleaf.live_states() == before, "captured autograd state leaked"
