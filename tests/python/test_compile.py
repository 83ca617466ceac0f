"""Leaf functions inside make_fx, AOTAutograd, torch.compile and export: one
opaque operator per call, never the real body, compiled == eager."""

import pytest
import torch
import torch._dynamo.testing
from functorch.compile import aot_function, nop
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import torchleaf
from torchleaf import LeafFunctionError

LEAF_OPS = {
    torch.ops.torchleaf.call.default,
    torch.ops.torchleaf.forward.default,
    torch.ops.torchleaf.backward.default,
    torch.ops.torchleaf.call_mutating.default,
    torch.ops.torchleaf.forward_mutating.default,
    torch.ops.torchleaf.call_functional.default,
    torch.ops.torchleaf.forward_functional.default,
}


def call_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def leaf_calls(gm):
    targets = call_targets(gm)
    calls = [t for t in targets if t in LEAF_OPS]
    # with_effects(token, op, ...) wraps effectful calls in AOT graphs.
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.higher_order.with_effects:
            calls.append(n.args[1])
    return calls


class Counter:
    def __init__(self):
        self.real = 0


def make_scaled(counter, state):
    @torchleaf.leaf_function
    def scaled(x):
        counter.real += 1
        if x.sum() > 0:  # data-dependent control flow
            return x * state["k"]
        return x - state["k"]

    @scaled.register_fake
    def _(x):
        return torch.empty_like(x)

    return scaled


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_one_opaque_call(mode):
    counter, state = Counter(), {"k": 2.0}
    scaled = make_scaled(counter, state)

    def program(x):
        return scaled(x).cos() + 1

    x = torch.rand(4) + 0.1
    gm = make_fx(program, tracing_mode=mode)(x)
    assert leaf_calls(gm) == [torch.ops.torchleaf.call.default]
    assert torch.ops.aten.mul.Tensor not in call_targets(gm)  # the body is not traced
    assert counter.real == (1 if mode == "real" else 0)
    for inp in (x, -x, torch.rand(4) + 3):
        torch.testing.assert_close(gm(inp), program(inp))
    state["k"] = 5.0  # closures are read when the graph runs
    torch.testing.assert_close(gm(x), (x * 5).cos() + 1)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_make_fx_with_autograd_records_forward_and_backward(mode):
    scaled = make_scaled(Counter(), {"k": 3.0})

    def grad_of(x):
        return torch.autograd.grad(scaled(x).sum(), x)[0]

    x = torch.randn(4, requires_grad=True)
    gm = make_fx(grad_of, tracing_mode=mode)(x)
    assert leaf_calls(gm) == [torch.ops.torchleaf.forward.default, torch.ops.torchleaf.backward.default]
    torch.testing.assert_close(gm(x.detach().abs().requires_grad_()), torch.full((4,), 3.0))


def _positives():
    @torchleaf.leaf_function
    def positives(x):
        return x[x > 0] * 2

    @positives.register_fake
    def _(x):
        return x.new_empty(x.nonzero().shape[0])

    return positives


@pytest.mark.slow
def test_unbacked_sizes_from_the_fake():
    positives = _positives()

    def program(x):
        return positives(x) + 1

    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0])
    gm = make_fx(program, tracing_mode="symbolic")(x)
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    size = out_node.args[0].meta["val"].shape[0]
    assert isinstance(size, torch.SymInt) and str(size).startswith("u")  # unbacked
    torch.testing.assert_close(gm(x), program(x))
    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(program, backend=backend, fullgraph=True)
        torch.testing.assert_close(compiled(x), program(x))
        torch.testing.assert_close(compiled(-x), program(-x))


def test_aot_function_graphs_hold_forward_and_backward_ops():
    graphs = {}

    def capture(name):
        def compiler(gm, _):
            graphs[name] = gm
            return gm

        return compiler

    scaled = make_scaled(Counter(), {"k": 3.0})
    f = aot_function(lambda x: scaled(x).sin(), fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    x = torch.rand(5, requires_grad=True)
    out = f(x)
    out.sum().backward()
    assert torch.ops.torchleaf.forward.default in leaf_calls(graphs["fw"])
    assert leaf_calls(graphs["bw"]) == [torch.ops.torchleaf.backward.default]
    xe = x.detach().requires_grad_()
    (xe * 3).sin().sum().backward()
    torch.testing.assert_close(out, (x * 3).sin())
    torch.testing.assert_close(x.grad, xe.grad)


class Model(nn.Module):
    def __init__(self, counter, settings):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.settings = settings

        @torchleaf.leaf_function
        def gate(h, head):
            counter.real += 1
            # Reads configuration that changes between steps.
            return head(h.relu()) * self.settings["temperature"] * head.scale

        @gate.register_fake
        def _(h, head):
            return h.new_empty(h.shape[0], 3)

        self.gate = gate
        self.head.scale = 1.0

    def forward(self, x):
        return self.gate(self.inp(x), self.head).log_softmax(-1)


def _train(model, steps, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.nll_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_torch_compile_trains_like_eager(backend):
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    eager_counter, compiled_counter = Counter(), Counter()
    eager = Model(eager_counter, {"temperature": 1.0})
    compiled_model = Model(compiled_counter, {"temperature": 1.0})
    compiled_model.load_state_dict(eager.state_dict())
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled_model.forward = torch.compile(compiled_model.forward, backend=cnt, fullgraph=True)

    want = _train(eager, 3, x, y)
    got = _train(compiled_model, 3, x, y)
    assert compiled_counter.real == eager_counter.real == 3  # once per call, never while compiling
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b)
    for ga, gb in zip(got[1], want[1]):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b)

    # Configuration and module attributes change results without recompiling.
    for m in (eager, compiled_model):
        m.settings["temperature"] = 0.5
        m.head.scale = 2.0
    torch.testing.assert_close(compiled_model(x), eager(x))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("grad", [False, True])
def test_side_effects_run_in_program_order_even_when_unused(backend, grad):
    """Calls run once each, in program order, whether their outputs are used
    or not and wherever they are used: they are ordered by the token they
    thread, and Inductor's reordering passes move independent nodes."""
    torch._dynamo.reset()
    log = []

    def make(tag):
        @torchleaf.leaf_function
        def record(x):
            log.append(tag)
            return x + 1

        @record.register_fake
        def _(x):
            return torch.empty_like(x)

        return record

    a, b, c = make("a"), make("b"), make("c")

    def program(x):
        y = x.sin()
        first = a(x)  # used last
        b(x)  # unused
        third = c(y * 2)
        return (third * 3).cos() + first.exp() * 2

    compiled = torch.compile(program, backend=backend, fullgraph=True)
    x = torch.randn(8, requires_grad=grad)
    for _ in range(2):
        log.clear()
        out = compiled(x)
        assert log == ["a", "b", "c"]
    log.clear()
    torch.testing.assert_close(out, program(x))


@pytest.mark.slow
def test_inductor_materializes_a_broadcast_gradient_once_for_the_replay():
    """`leaf(x, w).sum()` hands backward a stride-0 gradient. Under Inductor
    the backward operator asks for contiguous inputs, so the expand is
    written once by a fused kernel instead of being copied by every aten op
    of the replay that needs a dense operand (mm copies it for each of its
    two products). Values still match eager."""
    torch._dynamo.reset()
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad.stride())
            return grad

    @torchleaf.leaf_function
    def matmul(x, w):
        return Probe.apply(x @ w)

    @matmul.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda x, w: matmul(x, w).sum(), backend="inductor", fullgraph=True)
    compiled(x, w).backward()
    got = (x.grad, w.grad)
    assert seen == [(3, 1)]  # dense, not the expand's (0, 0)

    x.grad = w.grad = None
    matmul(x, w).sum().backward()
    assert seen[1] == (0, 0)  # eager hands the expand through, as plain code does
    torch.testing.assert_close(got, (x.grad, w.grad))


@pytest.mark.slow
def test_inductor_checks_no_size_the_core_guarantees():
    """Inductor asserts the size and stride of every graph input and extern
    kernel output it relies on (~0.4 µs each per step). The state handle
    (made by the core, read only by the backward operator) and the backward
    operator's gradients (validated against each input's metadata by the
    replay, and made contiguous) are not checked; the leaf's real outputs,
    which come from user code, still are. A wrong-shaped real output still
    fails, naming the leaf."""
    import re

    from torch._inductor.utils import run_fw_bw_and_get_code

    torch._dynamo.reset()

    @torchleaf.leaf_function
    def scale(x, w):
        return x * w

    @scale.register_fake
    def _(x, w):
        return torch.empty_like(x)

    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda x, w: scale(x, w).sum(), backend="inductor", fullgraph=True)
    _, (forward_code, backward_code) = run_fw_bw_and_get_code(lambda: compiled(x, w))
    got = (x.grad, w.grad)
    def checked(code):
        """(name, what) per size assert: one line each, or (2.14+) a line
        per group of inputs asserted together."""
        # (2.15 asserts extern kernel outputs with assert_tensor_metadata.)
        # (What a leaf's output assert names has quotes of its own: the
        # leaf's name. Its repr is in double quotes.)
        found = re.findall(r"assert_(?:size_stride|tensor_metadata)\((\w+), .*?, ['\"](.*)['\"]\)", code)
        for names, what in re.findall(r"assert_size_stride_grouped\(\(([\w, ]*)\), .*?, ['\"](.*)['\"]\)", code):
            found += [(name.strip(), what) for name in names.split(",") if name.strip()]
        return found

    # The graph inputs x, w and the leaf's output; not the order token (a
    # zero-size output, which Inductor asserts from 2.14 on, every step).
    forward_checks = sorted(op for _, op in checked(forward_code))
    assert forward_checks[:2] == ["input", "input"] and len(forward_checks) == 3, forward_checks
    assert re.match(r"torchleaf leaf function '.*scale': its real function returned", forward_checks[2])
    (call,) = re.findall(r"torch\.ops\.torchleaf\.backward\.default\(\w+, (\w+),", backward_code)
    # The gradient of the sum only: neither the state handle nor the
    # backward operator's gradients.
    assert [op for name, op in checked(backward_code) if name != call] == ["input"]
    assert call not in {name for name, _ in checked(backward_code)}
    x.grad = w.grad = None
    scale(x, w).sum().backward()
    torch.testing.assert_close(got, (x.grad, w.grad))

    @torchleaf.leaf_function
    def wrong(x):
        return x[:-1] * 2

    @wrong.register_fake
    def _(x):
        return torch.empty_like(x)

    with pytest.raises(torchleaf.LeafFunctionError, match="wrong"):
        torch.compile(lambda x: wrong(x).sum(), backend="inductor", fullgraph=True)(x)


def test_a_positional_call_guards_only_what_it_must():
    """Dynamo checks a compiled frame's guards on every call of it, and guards
    each global and attribute that traced code reads: each costs a little on
    every step. A leaf called with tensors by position adds a fixed, small
    number of guards to what plain code has, however often it is called, and
    none on the tensors beyond plain code's."""
    import re

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    leaf = torchleaf.leaf_function(lambda x, y: x * y + 1)
    leaf.register_fake(lambda x, y: torch.empty_like(x))

    def plain(x, y):
        return (x * y + 1).sum()

    def once(x, y):
        return leaf(x, y).sum()

    def thrice(x, y):
        return (leaf(x, y) + leaf(y, x) + leaf(x, x)).sum()

    def guard_sources(f):
        torch._dynamo.reset()
        torch.compile(f, backend="eager", fullgraph=True)(torch.randn(3), torch.randn(3))
        (entry,) = _debug_get_cache_entry_list(f.__code__)
        # (Dynamo numbers its builtins-dict globals per compile.)
        text = re.sub(r"__builtins_dict___\d+", "__builtins_dict___0", str(entry.guard_manager))
        return set(re.findall(r"source=(\S+?),", text))

    base, one, three = guard_sources(plain), guard_sources(once), guard_sources(thrice)
    assert base <= one and one == three
    # Nothing more on the inputs than plain code (the leaf itself is a local).
    assert {s for s in one if s.startswith("L[") and "leaf" not in s} == base
    assert len(one - base) <= 24, sorted(one - base)


def test_the_order_token_is_a_graph_input_only_when_a_call_needs_one():
    """A graph's first call has nothing to be ordered after: it takes no
    token, so a graph with leaf calls has no input (and no guards) beyond the
    user's tensors. Later calls take the token the previous call returned. A
    mutating call always takes one (from the last graph)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def make(mutates=()):
        @torchleaf.leaf_function(mutates_args=mutates)
        def step(x, stats=None):
            if stats is not None:
                stats.add_(1)
            return x + 1

        step.register_fake(lambda x, stats=None: torch.empty_like(x))
        return step

    a, b, bump = make(), make(), make({"stats"})

    def placeholders(fn, *args):
        torch._dynamo.reset()
        graphs.clear()
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
        (gm,) = graphs
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.torchleaf.call.default]
        return [n.name for n in gm.graph.nodes if n.op == "placeholder"], calls

    x, stats = torch.randn(3), torch.zeros(())
    names, _ = placeholders(lambda x: a(x) * 2, x)
    assert names == ["l_x_"]
    names, calls = placeholders(lambda x: b(a(x)), x)
    assert names == ["l_x_"]
    assert len(calls) == 2 and calls[0] in calls[1].args[2][-1].args  # the first call's token
    names, _ = placeholders(lambda x, s: bump(x, s), x, stats)
    assert len(names) == 3  # x, stats and the token of the last graph
    assert stats.item() == 1


@pytest.mark.parametrize("backend", ["aot_function", "aot_eager", "inductor"])
def test_declared_mutation_under_compilation(backend):
    @torchleaf.leaf_function(mutates_args={"stats"})
    def track(x, stats):
        stats.add_(x.detach().mean())
        return x * 2

    @track.register_fake
    def _(x, stats):
        return torch.empty_like(x)

    def program(x, stats):
        return track(x, stats).sin()

    if backend == "aot_function":
        compiled = aot_function(program, fw_compiler=nop, bw_compiler=nop)
    else:
        compiled = torch.compile(program, backend=backend, fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    stats_eager, stats_compiled = torch.zeros(()), torch.zeros(())
    want = program(x, stats_eager)
    got = compiled(x, stats_compiled)
    got = compiled(x, stats_compiled) * 1 + got * 0
    program(x, stats_eager)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(stats_compiled, stats_eager)
    got.sum().backward()


@pytest.mark.parametrize("tracer", ["make_fx", "aot_function", "compile"])
def test_missing_fake_under_any_tracer(tracer):
    @torchleaf.leaf_function
    def lonely(x):
        return x + 1

    x = torch.randn(2, requires_grad=True)
    if tracer == "make_fx":
        run = make_fx(lonely, tracing_mode="fake")
    elif tracer == "aot_function":
        run = aot_function(lonely, fw_compiler=nop, bw_compiler=nop)
    else:
        run = torch.compile(lonely, backend="aot_eager", fullgraph=True)
    # Under torch.compile the error reaches the user wrapped by Dynamo, with
    # torchleaf's error (and its text) as the cause.
    raised = torch._dynamo.exc.TorchRuntimeError if tracer == "compile" else LeafFunctionError
    with pytest.raises(raised, match=r"leaf function '[\w.<>]*\.lonely' requires a fake implementation") as info:
        run(x)
    root = info.value
    while root.__cause__ or root.__context__:
        root = root.__cause__ or root.__context__
    assert type(root) is LeafFunctionError and "register_fake" in str(root)


def test_cpp_leaf_compiles_and_trains(cpp_leaves):
    ops, lib = cpp_leaves

    def program(x, b):
        return ops.scale_bias([x, b])[0].tanh()

    x = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
        compiled = torch.compile(program, backend=cnt, fullgraph=True)
        got = compiled(x, b)
        gx, gb = torch.autograd.grad(got.sum(), (x, b))
        want = (x * 2 + b).tanh()
        ex, eb = torch.autograd.grad(want.sum(), (x, b))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gb, eb)
        lib.torchleaf_test_set_scale(3.0)  # C++ state read on every call
        try:
            torch.testing.assert_close(compiled(x, b), (x * 3 + b).tanh())
        finally:
            lib.torchleaf_test_set_scale(2.0)
        assert cnt.frame_count == 1


def test_export_cpp_leaf_saves_loads_and_runs(cpp_leaves, tmp_path):
    ops, _ = cpp_leaves

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, b):
            return ops.scale_bias([self.lin(x), b])[0].relu()

    net = Net()
    x, b = torch.randn(3, 4), torch.randn(3, 4)
    ep = torch.export.export(net, (x, b))
    targets = call_targets(ep.graph_module)
    assert targets.count(torch.ops.torchleaf_test.scale_bias.default) == 1
    path = tmp_path / "net.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    for inp in ((x, b), (torch.randn(3, 4), torch.randn(3, 4))):
        torch.testing.assert_close(loaded.module()(*inp), net(*inp))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cpp_leaf_declared_mutation_under_compilation(cpp_leaves, backend):
    ops, _ = cpp_leaves

    def program(x, counter):
        return ops.count_calls([x], [counter])[0] * 2

    compiled = torch.compile(program, backend=backend, fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    counter = torch.zeros(())
    out = compiled(x, counter)
    compiled(x, counter)
    assert counter.item() == 2
    torch.testing.assert_close(out, x.sin() * 2)
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(gx, 2 * x.cos())


_CACHE_SCRIPT = r"""
import sys, torch, torchleaf
library, python_first = sys.argv[1], sys.argv[2] == "python-first"

def python_leaves():
    for k in range(5):  # shifts the registry positions of what comes after
        torchleaf.leaf_function(lambda x, k=k: x + k).register_fake(torch.empty_like)

if python_first:
    python_leaves()
torchleaf.load_library(library)
if not python_first:
    python_leaves()
ops = torch.ops.torchleaf_test
x = torch.randn(4, requires_grad=True)
counter = torch.zeros(())
compiled = torch.compile(lambda x, c: ops.count_calls([x], [c])[0] * 2, backend="inductor", fullgraph=True)
out = compiled(x, counter)
torch.testing.assert_close(out, x.sin() * 2)
torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], 2 * x.cos())
assert counter.item() == 1
print("ok")
"""


@pytest.mark.slow
def test_on_disk_compile_caches_never_mix_leaves(cpp_leaves, tmp_path):
    """Processes that register leaves in a different order share PyTorch's
    on-disk compilation caches (AOTAutograd's is keyed by the Dynamo graph,
    where a C++ leaf is its named operator); each must still run its own
    leaf."""
    import os
    import subprocess
    import sys

    from conftest import _test_library_path

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    for order in ("python-first", "cpp-first", "python-first"):
        proc = subprocess.run(
            [sys.executable, "-c", _CACHE_SCRIPT, _test_library_path(), order],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


_WARM_SCRIPT = r"""
import sys, torch, torchleaf
from torch._dynamo.utils import counters
offset, short = float(sys.argv[1]), sys.argv[2] == "short"
calls = []

def body(x, short):  # one name in every process; what it computes differs
    calls.append(1)
    y = x * 2 + offset
    return y[:2] if short else y

leaf = torchleaf.leaf_function(body)
leaf.register_fake(lambda x, short: x[:2].clone() if short else torch.empty_like(x))
x = torch.randn(8, requires_grad=True)
out = torch.compile(lambda x: leaf(x, short).tanh(), backend="inductor", fullgraph=True)(x)
want = body(x, short).tanh()
torch.testing.assert_close(out, want)
torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
assert len(calls) == 2  # the compiled call and `want`
print("hits", counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"])
"""


@pytest.mark.slow
def test_warm_restarts_hit_the_on_disk_compile_caches(tmp_path):
    """By default a graph with a Python leaf is never reused by another
    process: PyTorch's on-disk caches key graphs by their text, which does not
    show the shapes a leaf's fake gives. With TORCHLEAF_STABLE_IDS=1 (every
    process defines the same leaves with the same fakes) a second process
    finds the first one's graphs, and what they call is its own leaf; a call
    with another constant baked into its plan gets graphs of its own."""
    import os
    import subprocess
    import sys

    def run(offset, short, **env):
        proc = subprocess.run(
            [sys.executable, "-c", _WARM_SCRIPT, offset, short],
            env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), **env),
            capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split("hits")[-1].split()

    assert run("1.0", "long") == ["0", "0"]
    assert run("5.0", "long") == ["0", "0"]
    stable = {"TORCHLEAF_STABLE_IDS": "1"}
    assert run("1.0", "long", **stable) == ["0", "0"]
    hits = run("5.0", "long", **stable)
    assert int(hits[0]) >= 1 and int(hits[1]) >= 1, hits
    # Another constant, which the graph does not show and which changes the
    # output's shape: not the others' graphs.
    assert run("1.0", "short", **stable) == ["0", "0"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_changing_int_arguments_stay_symbolic(backend):
    """Dynamo makes an int that changes between calls dynamic; the leaf gets
    the right value each call (the real function a Python int, the fake a
    symbolic one it can use for shapes) without a recompile per value."""
    seen = []

    @torchleaf.leaf_function
    def repeat(x, n, offset):
        seen.append(n)
        return x * n + offset, x.new_ones(abs(n))

    @repeat.register_fake
    def _(x, n, offset):
        return torch.empty_like(x), x.new_empty(abs(n))

    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(lambda x, n: repeat(x, n, -2), backend=cnt, fullgraph=True)
    x = torch.randn(3, requires_grad=True)
    values = [2, 3, 4, 5, 6, 7, 8, 9]
    for n in values:
        out, ones = compiled(x, n)
        torch.testing.assert_close(out, x * n - 2)
        assert ones.shape == (n,)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.full((3,), float(n)))
    assert seen == values
    assert cnt.frame_count <= 2  # static first, then dynamic


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_double_backward_is_a_clear_error(backend):
    # Double backward through a leaf is eager-only, as through any compiled
    # AOTAutograd graph. PyTorch refuses only a second backward that reaches
    # its double-backward node, which names no leaf; autograd.grad of an
    # input that the node does not reach got None or zero silently (issue
    # 36), so the leaf's backward refuses create_graph=True itself.
    def wave(x):
        return x.sin()

    leaf = torchleaf.leaf_function(wave)
    leaf.register_fake(torch.empty_like)
    x = torch.randn(3, requires_grad=True)
    (first,) = torch.autograd.grad(leaf(x).sum(), x, create_graph=True)  # eager: works
    torch.testing.assert_close(torch.autograd.grad(first.sum(), x)[0], -x.sin())
    compiled = torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    with pytest.raises(torchleaf.LeafFunctionError, match=r"leaf function '.*wave' .*create_graph=True"):
        torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    (first,) = torch.autograd.grad(compiled(x).sum(), x)
    torch.testing.assert_close(first, x.cos())  # first derivatives are fine


def test_leaf_operators_keep_graphs_out_of_cuda_graphs(cpp_leaves):
    """A CUDA graph replays the kernels one call launched: a leaf's function
    (its control flow, side effects, host syncs) would never run again under
    torch.compile(mode="reduce-overhead"). Every operator that runs a leaf is
    tagged cudagraph_unsafe, which Inductor checks before capturing a graph
    (or partitions around). CPU only here: checked through the tag and
    Inductor's own test of a graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    ops, _ = cpp_leaves
    named_python = torchleaf.leaf_function(name="torchleaf_compile_test::doubled")(lambda x: x * 2)
    named_python.register_fake(torch.empty_like)
    overloads = [getattr(torch.ops.torchleaf, name).default for name in (
        "call", "forward", "backward", "call_mutating", "forward_mutating",
        "call_functional", "forward_functional",
    )] + [ops.sin3.default, torch.ops.torchleaf_compile_test.doubled.default]
    for overload in overloads:
        assert torch.Tag.cudagraph_unsafe in overload.tags, overload

    leaf = torchleaf.leaf_function(lambda x: x.sin())
    leaf.register_fake(torch.empty_like)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    torch.compile(lambda x: leaf(x * 2).sum(), backend=backend, fullgraph=True)(
        torch.randn(3, requires_grad=True)
    ).backward()
    forward_graph, backward_graph = graphs
    assert get_first_incompatible_cudagraph_node(forward_graph).target is torch.ops.torchleaf.forward.default
    assert get_first_incompatible_cudagraph_node(backward_graph).target is torch.ops.torchleaf.backward.default
