"""Exporting Python leaves by name (@leaf_function(name="ns::op")): one
operator node per call, saved and loaded in a fresh process that imports the
defining module, with the same outputs and gradients; clear errors where a
call cannot be exported; torch.library.opcheck on every kind of leaf
operator."""

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

import torchleaf
from torchleaf import LeafFunctionError

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _exported_leaves as defs  # noqa: E402

_GATE = torch.ops.torchleaf_export_test.gate.default


def _targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def _leaf_calls(ep, op):
    # run_decompositions wraps ordered calls in with_effects(token, op, ...)
    return [n for n in ep.graph.nodes if n.op == "call_function" and (n.target is op or op in n.args)]


def _inputs():
    torch.manual_seed(0)
    # Both branches of gate: a tracer that baked one in would fail one case.
    return [torch.randn(3, 4), -torch.ones(3, 4) * 5, torch.ones(3, 4) * 5]


def _eager(net, x):
    net.zero_grad()
    out = net(x)
    out.sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}


def _run_subprocess(code, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_named_leaf_exports_as_one_operator_node(strict):
    net = defs.Net()
    x = _inputs()[0]
    ep = torch.export.export(net, (x,), strict=strict)
    calls = _leaf_calls(ep, _GATE)
    assert len(calls) == 1
    call = json.loads(calls[0].args[-1])
    assert call["leaf"] == "torchleaf_export_test::gate" and call["import"] == "_exported_leaves"
    for inp in _inputs():
        torch.testing.assert_close(ep.module()(inp), net(inp))


@pytest.mark.slow
def test_saved_program_runs_in_a_fresh_process_with_gradients(tmp_path):
    net = defs.Net()
    ep = torch.export.export(net, (_inputs()[0],))
    torch.export.save(ep, tmp_path / "net.pt2")
    expected = [_eager(net, x) for x in _inputs()]
    torch.save({"inputs": _inputs(), "expected": expected}, tmp_path / "ref.pt")
    proc = _run_subprocess(
        """
        import torch
        import _exported_leaves as defs  # registers torchleaf_export_test::gate
        ep = torch.export.load("net.pt2")
        ref = torch.load("ref.pt")
        m = ep.module()
        assert len([n for n in ep.graph.nodes if n.target is torch.ops.torchleaf_export_test.gate.default]) == 1
        before = defs.CALLS["gate"]
        for x, (out, grads) in zip(ref["inputs"], ref["expected"]):
            m.zero_grad()
            got = m(x)
            got.sum().backward()
            torch.testing.assert_close(got, out)
            for name, p in m.named_parameters():
                torch.testing.assert_close(p.grad, grads[name], msg=name)
        assert defs.CALLS["gate"] - before == len(ref["inputs"])  # the real function, once per call
        print("fresh process: outputs and gradients equal")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "outputs and gradients equal" in proc.stdout


@pytest.mark.slow
def test_loading_without_the_defining_module_names_it(tmp_path):
    ep = torch.export.export(defs.Net(), (_inputs()[0],))
    torch.export.save(ep, tmp_path / "net.pt2")
    proc = _run_subprocess(
        """
        import torch, torchleaf
        torch.export.load("net.pt2")
        """,
        tmp_path,
    )
    assert proc.returncode != 0
    # PyTorch's own message, on the node that carries the module to import.
    assert "torch.ops.torchleaf_export_test.gate.default" in proc.stderr
    assert '"import":"_exported_leaves"' in proc.stderr


def test_run_decompositions_keeps_the_leaf_and_its_values():
    net = defs.Net()
    ep = torch.export.export(net, (_inputs()[0],)).run_decompositions()
    assert len(_leaf_calls(ep, _GATE)) == 1
    assert not [t for t in _targets(ep) if "torchleaf." in str(t)]  # no process-local generic op
    for inp in _inputs():
        torch.testing.assert_close(ep.module()(inp), net(inp))


def test_mutating_named_leaf_exports_and_mutates_the_buffer():
    m = defs.Accumulating()
    x = torch.randn(3, 4)
    ep = torch.export.export(m, (x,))
    assert len(_leaf_calls(ep, torch.ops.torchleaf_export_test.accumulate.default)) == 1
    loaded = ep.module()
    expected_total = m.total + x.sum(0)
    torch.testing.assert_close(loaded(x), x * 2 + 1)
    torch.testing.assert_close(loaded.total, expected_total)


def test_unnamed_leaf_export_error_mentions_name():
    @torchleaf.leaf_function
    def scaled(x):
        return x * 2

    scaled.register_fake(lambda x: torch.empty_like(x))

    class Net(nn.Module):
        def forward(self, x):
            return scaled(x)

    with pytest.raises(LeafFunctionError, match=r"'[\w.<>]*scaled' cannot be exported without a name.*name="):
        torch.export.export(Net(), (torch.randn(3),))


def test_arguments_an_exported_program_cannot_store_are_clear_errors():
    @torchleaf.leaf_function(name="torchleaf_export_test::takes_anything")
    def takes_anything(x, extra):
        return x * 2

    takes_anything.register_fake(lambda x, extra: torch.empty_like(x))

    class WithModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return takes_anything(x, self.lin)

    with pytest.raises(LeafFunctionError, match=r"torchleaf_export_test::takes_anything' got a Linear argument in an exported call"):
        torch.export.export(WithModule(), (torch.randn(3),))

    class WithObject(nn.Module):
        def forward(self, x):
            return takes_anything(x, object())

    with pytest.raises(LeafFunctionError, match=r"got a object as flat argument 1 of an exported call"):
        torch.export.export(WithObject(), (torch.randn(3),))


def test_names_are_unique_while_alive_and_rebind_after():
    def make(k):
        @torchleaf.leaf_function(name="torchleaf_export_test::rebound")
        def rebound(x):
            return x * k

        rebound.register_fake(lambda x: torch.empty_like(x))
        return rebound

    first = make(2)
    with pytest.raises(LeafFunctionError, match=r"torchleaf_export_test::rebound' is already the name of a live leaf"):
        make(3)

    class Net(nn.Module):
        def forward(self, x):
            return first(x)  # noqa: F821 (deleted below, after this is traced)

    x = torch.randn(3)
    ep = torch.export.export(Net(), (x,))
    torch.testing.assert_close(ep.module()(x), x * 2)
    # The operator holds no leaf: the leaf dies with its last user ...
    ref = weakref.ref(first)
    del first, Net
    gc.collect()
    assert ref() is None
    with pytest.raises(LeafFunctionError, match=r"not bound to a live leaf function.*_exported_leaves|not bound to a live leaf"):
        ep.module()(x)
    # ... and a leaf defined again under the name serves old programs.
    second = make(5)
    torch.testing.assert_close(ep.module()(x), x * 5)
    del second


def test_opcheck_on_leaf_operators(cpp_leaves):
    from torch.library import opcheck

    ops, _ = cpp_leaves
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    # A named Python leaf's operator, with the call description export records.
    ep = torch.export.export(defs.Net(), (_inputs()[0],))
    call = _leaf_calls(ep, _GATE)[0].args[-1]
    results = [opcheck(_GATE, ([x, w], call))]
    # A C++ leaf's named operator.
    results.append(opcheck(ops.scale_bias.default, ([x, x.detach().clone().requires_grad_()],)))
    # The generic operator a Python leaf's compiled calls go through.
    from _graphs import traced_call_site

    leaf_id, plan = traced_call_site(defs.gate, x.detach(), w.detach())
    results.append(opcheck(torch.ops.torchleaf.call.default, (leaf_id, plan, [x, w])))
    for result in results:
        assert set(result.values()) == {"SUCCESS"}, result
