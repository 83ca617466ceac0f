"""Issue 36: results that were silently wrong. Each case is now right, or a
LeafFunctionError that names the leaf and says what to do, eager and
compiled alike. One test per case."""

import pytest
import torch
from torch import autograd

import torchleaf
from torchleaf import LeafFunctionError
from torchleaf._torch_private import TORCH_VERSION


def square_of_product():
    @torchleaf.leaf_function
    def h(x, w):
        return (x * w) ** 2

    @h.register_fake
    def _(x, w):
        return torch.empty_like(x)

    return h


def inputs():
    x = torch.tensor([1.5, -2.0], requires_grad=True)
    w = torch.tensor([0.5, 3.0], requires_grad=True)
    return x, w


def test_mixed_second_derivative_of_a_compiled_leaf_is_a_clear_error():
    # AOTAutograd differentiates a compiled graph's gradient only through the
    # tensors the graph saved; a leaf saves its state handle, so the mixed
    # derivative d/dw (d/dx sum((x w)^2)) = 4 x w came back None.
    h = square_of_product()
    x, w = inputs()
    gx, = autograd.grad(h(x, w).sum() + (w * 1.0).sum(), x, create_graph=True)
    torch.testing.assert_close(autograd.grad(gx.sum(), w)[0], 4 * x.detach() * w.detach())  # eager: right
    g = torch.compile(lambda x, w: h(x, w).sum() + (w * 1.0).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(LeafFunctionError, match=r"leaf function '.*h' .*create_graph=True.*eager calls"):
        autograd.grad(g(x, w), x, create_graph=True)
    # A first derivative without create_graph is unaffected.
    gx, = autograd.grad(g(x, w), x)
    torch.testing.assert_close(gx, 2 * x.detach() * w.detach() ** 2)


def test_compiled_func_grad_of_a_leaf_differentiated_again_is_a_clear_error():
    # A traced forward's handle has no CapturedState to keep the refused
    # outer edge on, so the gradient the trace computed reached no outer
    # input: w.grad was [1, 1] where the plain function gives [4, -23].
    h = square_of_product()
    x = torch.tensor([1.5, -2.0])
    w = torch.tensor([0.5, 3.0], requires_grad=True)

    def f(x, w):
        return torch.func.grad(lambda x: h(x, w).sum())(x).sum() + (w * 1.0).sum()

    with pytest.raises(LeafFunctionError, match=r"leaf function '.*h' computed a gradient that is being differentiated again"):
        f(x, w).backward()  # eager
    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    # (Raised while AOTAutograd traces the joint graph, inside Dynamo's
    # BackendCompilerFailed.)
    with pytest.raises(Exception, match=r"leaf function '.*h' computed a gradient that is being differentiated again") as info:
        g(x, w).backward()
    assert isinstance(info.value, LeafFunctionError) or isinstance(info.value.__cause__, LeafFunctionError) or "LeafFunctionError" in str(info.value)
    # Differentiating once still works (the remedy the message gives).
    with torch.no_grad():
        torch.testing.assert_close(g(x, w), f(x, w))


def test_a_compiled_call_with_a_shallow_copy_of_a_module_runs_on_the_copy():
    # copy.copy(module) shares the original's torchleaf handle (its __dict__
    # entry), and the compiled path passed that handle's tensor: the real
    # function ran on the original (-0.92 instead of -9.23 in the issue).
    import copy

    from torch import nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)
            self.scale = 1.0

        def forward(self, x):
            return self.lin(x) * self.scale

    @torchleaf.leaf_function
    def run(m, x):
        return m(x)

    @run.register_fake
    def _(m, x):
        return x.new_empty(x.shape[0], 1)

    torch.manual_seed(0)
    layers, x = [Scaled() for _ in range(3)], torch.randn(2, 3)
    for m in layers:
        run(m, x)  # each has a handle of its own
    f = torch.compile(lambda m, x: run(m, x), backend="aot_eager", fullgraph=True)
    for m in layers:
        torch.testing.assert_close(f(m, x), m(x))
    copied = copy.copy(layers[0])
    copied.scale = 10.0
    for _ in range(2):
        torch.testing.assert_close(f(copied, x), copied(x))
        torch.testing.assert_close(f(layers[0], x), layers[0](x))
    # Modules with handles of their own still share one graph.
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for m in layers:
        torch.testing.assert_close(f(m, x), m(x))
    assert counters["stats"]["unique_graphs"] == 1


def test_the_output_check_goes_on_past_16_static_input_signatures():
    # The always-on check of real outputs against the fake's kept 16 input
    # signatures per plan and disabled itself at the 17th: from then on a
    # wrong fake gave aot_eager graphs silent garbage.
    @torchleaf.leaf_function
    def drop_last(x):
        return x[:-1] * 2

    @drop_last.register_fake
    def _(x):
        return torch.empty_like(x)  # wrong: one row too many

    g = torch.compile(lambda x: drop_last(x) + 1, backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=64, cache_size_limit=64):
        for n in range(2, 21):
            with pytest.raises(LeafFunctionError, match=r"leaf function '.*drop_last' output 0 has shape"):
                g(torch.ones(n, 2))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_declared_mutation_made_before_the_body_raises_is_kept_compiled_too(requires_grad):
    # Compiled calls ran the body on clones of the declared-mutable
    # arguments, written back only when the call returned: an error after
    # the change lost it, where eager calls and plain code keep it.
    @torchleaf.leaf_function(mutates_args=("buf",))
    def count_then_check(x, buf):
        buf.add_(1)
        if x.sum() > 0:
            raise ValueError("positive input")
        return x * 2

    @count_then_check.register_fake
    def _(x, buf):
        return torch.empty_like(x)

    compiled = torch.compile(lambda x, b: count_then_check(x, b), backend="aot_eager", fullgraph=True)
    for call in (count_then_check, compiled):
        buf = torch.zeros(2)
        call(-torch.ones(2, requires_grad=requires_grad), buf)
        torch.testing.assert_close(buf, torch.ones(2))
        with pytest.raises(ValueError, match="positive input"):
            call(torch.ones(2, requires_grad=requires_grad), buf)
        torch.testing.assert_close(buf, torch.full((2,), 2.0))


_STABLE_SCRIPT = """
import sys, torch, torchleaf
from torch._dynamo.utils import counters
dt = getattr(torch, sys.argv[1])

@torchleaf.leaf_function
def convert(x):
    return x.to(dt) * 2

@convert.register_fake
def _(x):
    return torch.empty_like(x, dtype=dt)

out = torch.compile(lambda x: convert(x) + 1, backend="inductor", fullgraph=True)(torch.arange(4.0))
print("out", out.dtype, out.tolist())
print("hits", counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"])
"""


@pytest.mark.slow
def test_stable_ids_do_not_reuse_a_graph_traced_with_another_fake(tmp_path):
    # With TORCHLEAF_STABLE_IDS=1 a leaf's id is the same in every process,
    # and the on-disk caches key graphs by their text, which does not show
    # what the fake gives: a second process whose fake returns float32 got
    # the first one's float64 code (garbage, or a crash in free()).
    import os
    import subprocess
    import sys

    def run(dtype):
        proc = subprocess.run(
            [sys.executable, "-c", _STABLE_SCRIPT, dtype],
            env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHLEAF_STABLE_IDS="1"),
            capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split("out")[-1].split()

    assert run("float64") == ["torch.float64", "[1.0,", "3.0,", "5.0,", "7.0]", "hits", "0", "0"]
    assert run("float32") == ["torch.float32", "[1.0,", "3.0,", "5.0,", "7.0]", "hits", "0", "0"]


def test_a_compiled_classmethod_leaf_is_a_clear_error():
    class Scale:
        factor = 2.0

        @classmethod
        @torchleaf.leaf_function
        def apply(cls, x):
            return x * cls.factor

    Scale.apply.register_fake(lambda cls, x: torch.empty_like(x))
    torch.testing.assert_close(Scale.apply(torch.ones(2)), torch.full((2,), 2.0))  # eager works
    f = torch.compile(lambda x: Scale.apply(x), backend="eager", fullgraph=True)
    # (Dynamo reports the error it observed inside its own Unsupported.)
    with pytest.raises(Exception, match=r"leaf function '.*apply' is a @classmethod.*@staticmethod"):
        f(torch.ones(2))
    g = torch.compile(lambda x: Scale.apply(x), backend="eager")
    if TORCH_VERSION >= (2, 15):
        # 2.15's Dynamo reports an exception raised in a descriptor's
        # __get__, which it runs natively, as its own internal error, not a
        # graph break: without fullgraph too, the same clear error.
        with pytest.raises(Exception, match=r"leaf function '.*apply' is a @classmethod.*@staticmethod"):
            g(torch.ones(2))
    else:
        # Without fullgraph, a graph break: the call runs eagerly.
        torch.testing.assert_close(g(torch.ones(2)), torch.full((2,), 2.0))


def _gate_body(x):
    return x.relu()


_gate = torchleaf.leaf_function(_gate_body)  # the call form


def _hidden_body(x):
    return x


def test_a_model_holding_a_leaf_made_with_the_call_form_pickles():
    # A leaf pickles by reference, by its qualified name, which the call
    # form leaves bound to the undecorated function: PicklingError "it's not
    # the same object as ...". Now found by the name bound to the leaf.
    import pickle

    from torch import nn

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = _gate

    model = Gated()
    assert pickle.loads(pickle.dumps(model.gate)) is _gate
    # A leaf bound to no module-level name is a clear error.
    with pytest.raises(LeafFunctionError, match=r"leaf function '.*_hidden_body' cannot be pickled.*module-level name"):
        pickle.dumps(torchleaf.leaf_function(_hidden_body))


def test_a_tensor_default_argument_that_requires_grad_gets_its_gradient():
    # A default is not an argument of the call: its gradient was reported as
    # escaping "through a closure or a global". Now it is passed explicitly
    # when the call omits it, and gets the undecorated function's gradient.
    weight = torch.tensor([2.0, 3.0], requires_grad=True)

    def scaled(x, w=weight):
        return x * w

    leaf = torchleaf.leaf_function(scaled)
    leaf.register_fake(lambda x, w=weight: torch.empty_like(x))
    compiled = torch.compile(lambda x: leaf(x), backend="aot_eager", fullgraph=True)
    for call in (leaf, compiled):
        x = torch.tensor([1.0, -1.0], requires_grad=True)
        got = torch.autograd.grad(call(x).sum(), [x, weight])
        want = torch.autograd.grad(scaled(x).sum(), [x, weight])
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(leaf(torch.ones(2)), torch.tensor([2.0, 3.0]))
    other = torch.ones(2, requires_grad=True)  # passed explicitly: that one
    torch.testing.assert_close(torch.autograd.grad(leaf(torch.ones(2), other).sum(), other)[0], torch.ones(2))


def test_a_fake_returning_a_symbolic_bool_says_what_to_do():
    # The message said "Return tensors (e.g. torch.empty(...)) for array
    # outputs", which does not fit a SymBool or SymFloat.
    @torchleaf.leaf_function
    def long_enough(x):
        return x * 2, x.shape[0] > 2

    long_enough.register_fake(lambda x: (torch.empty_like(x), x.shape[0] > 2))
    g = torch.compile(lambda x: long_enough(x), backend="aot_eager", fullgraph=True, dynamic=True)
    # (Raised while Dynamo runs the fake, inside its TorchRuntimeError.)
    with pytest.raises(Exception, match=r"leaf function '.*long_enough' returned a SymBool as output\[1\].*0-d tensor"):
        g(torch.ones(3))


@pytest.mark.slow
def test_inductors_size_assert_names_the_leaf():
    """A fake wrong only for some sizes (right for even lengths): under
    Inductor with dynamic shapes, Inductor's own size assert of the output
    fires first, and said "Error in op: torch.ops.torchleaf...call.default
    ... Use torch.library.opcheck", naming no leaf."""
    torch._dynamo.reset()

    @torchleaf.leaf_function
    def double(x):
        return x * 2

    @double.register_fake
    def _(x):
        return x.new_empty((x.shape[0] // 2) * 2)  # wrong for odd lengths

    f = torch.compile(lambda x: double(x) + 1, backend="inductor", dynamic=True, fullgraph=True)
    torch.testing.assert_close(f(torch.ones(6)), torch.full((6,), 3.0))
    with pytest.raises(AssertionError, match=r"torchleaf leaf function '.*double'.*fix the fake"):
        f(torch.ones(7))
