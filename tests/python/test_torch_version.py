"""The C++ extension records the torch it was built against, and torchleaf
refuses to run it under another release (a C++ extension is compiled against
one release's C++ ABI)."""

import pytest
import torch

import torchleaf
from torchleaf import _C


def test_the_extension_was_built_against_the_running_torch():
    assert torch.__version__.startswith(_C.BUILT_TORCH_VERSION + "+") or torch.__version__ == _C.BUILT_TORCH_VERSION
    torchleaf._check_torch_version(_C.BUILT_TORCH_VERSION, torch.__version__)


@pytest.mark.parametrize("running", ["2.13.0", "2.13.0+cpu", "2.13.0+cu130"])
def test_the_same_release_of_another_build_loads(running):
    torchleaf._check_torch_version("2.13.0", running)


@pytest.mark.parametrize("running", ["2.14.1+cu130", "2.13.1", "2.12.1+cpu", "3.13.0"])
def test_another_release_is_refused_with_both_versions_and_the_fix(running):
    with pytest.raises(ImportError) as caught:
        torchleaf._check_torch_version("2.13.0", running)
    message = str(caught.value)
    assert "built against torch 2.13.0" in message
    assert f"torch {running} is installed" in message
    assert "pip install --no-build-isolation" in message
    assert "make build" in message
    assert "torch==2.13.0" in message


def test_a_pre_release_is_its_release():
    torchleaf._check_torch_version("2.15.0", "2.15.0.dev20260101+cpu")
    torchleaf._check_torch_version("2.15.0", "2.15.0a0+git5c48869")
    with pytest.raises(ImportError):
        torchleaf._check_torch_version("2.15.0", "2.16.0.dev20260101+cpu")


def test_a_compiled_call_is_not_an_exported_one():
    """torch.compile is not torch.export: a compiled call of an unnamed leaf
    runs (on 2.11, whose Dynamo answers torch.compiler.is_exporting() with
    True in every trace, it took the exported path and asked for a name),
    and torch.export still knows it exports."""
    import torchleaf
    from torchleaf._torch_private import is_exporting

    leaf = torchleaf.leaf_function(lambda x: x * 2)
    leaf.register_fake(torch.empty_like)
    x = torch.ones(3)
    torch.testing.assert_close(torch.compile(lambda x: leaf(x), backend="eager", fullgraph=True)(x), x * 2)
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(is_exporting())
            return x + 1

    torch.export.export(Probe(), (x,))
    assert seen and all(seen)
    assert not is_exporting()
