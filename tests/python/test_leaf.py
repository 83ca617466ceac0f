"""Eager Python leaf functions: the decorator's surface, pytrees, modules,
declared mutation, validation, errors and the single operator call."""

import collections
import re

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchleaf
from torchleaf import LeafFunctionError

Pair = collections.namedtuple("Pair", ["first", "second"])


def test_returns_exactly_what_the_function_returns():
    calls = []

    def body(x, cfg, *, extra=None):
        calls.append(1)
        if x.sum() > 0:  # data-dependent control flow
            y = x * cfg["scale"]
        else:
            y = -x
        return {"y": y, "pair": Pair(y.sum(), [x + 1, cfg["tag"]]), "none": None}, 7

    leaf = torchleaf.leaf_function(body)
    x = torch.rand(3) + 0.5
    cfg = {"scale": 3.0, "tag": "t"}
    got = leaf(x, cfg, extra=None)
    want = body(x, cfg, extra=None)
    assert type(got) is tuple and got[1] == 7
    assert set(got[0]) == {"y", "pair", "none"} and got[0]["none"] is None
    assert isinstance(got[0]["pair"], Pair)
    torch.testing.assert_close(got[0]["y"], want[0]["y"])
    torch.testing.assert_close(got[0]["pair"].first, want[0]["pair"].first)
    torch.testing.assert_close(got[0]["pair"].second[0], want[0]["pair"].second[0])
    assert got[0]["pair"].second[1] == "t"
    assert len(calls) == 2  # one real call per call

    # A single tensor, and None (a logging-only leaf).
    single = torchleaf.leaf_function(lambda x: x * 2)
    assert isinstance(single(x), torch.Tensor)
    logged = []
    log = torchleaf.leaf_function(lambda x: logged.append(float(x.sum())))
    assert log(x) is None and logged == [pytest.approx(float(x.sum()))]


def test_closures_and_module_attributes_are_read_on_every_call():
    state = {"k": 1.0}

    @torchleaf.leaf_function
    def scaled(x, mod):
        return mod(x) * state["k"] * mod.gain

    mod = nn.Linear(2, 2)
    mod.gain = 1.0
    x = torch.randn(4, 2)
    a = scaled(x, mod)
    state["k"] = 2.0
    mod.gain = 3.0
    torch.testing.assert_close(scaled(x, mod), a * 6)


def test_module_parameters_and_buffers_are_inputs():
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("shift", torch.ones(3))

    seen = []

    @torchleaf.leaf_function
    def apply(m, x):
        w, shift = m.lin.weight, m.shift
        seen.append((type(w), w is weight, shift is buffer, torch.equal(w, weight), torch.equal(shift, buffer)))
        return m.lin(x) + m.shift

    m = Norm()
    weight, buffer = m.lin.weight, m.shift
    x = torch.randn(2, 3, requires_grad=True)
    with torch.no_grad():
        apply(m, x)
    out = apply(m, x)
    # Inside a call the module holds the leaf's inputs. Under no_grad those
    # are plain tensors reparametrised in; an eager call that records
    # autograd gives the function each parameter itself, as the plain
    # function sees it, whose gradient then accumulates directly. A buffer
    # (no gradient) is an alias of the module's.
    assert seen == [(torch.Tensor, False, False, True, True), (nn.Parameter, True, False, True, True)]
    torch.testing.assert_close(out, m.lin(x) + m.shift)
    out.sum().backward()
    assert m.lin.weight.grad is not None and m.lin.bias.grad is not None
    torch.testing.assert_close(m.lin.bias.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(x.grad, m.lin.weight.sum(0).expand(2, 3))
    # After the call the module holds its own parameters and buffers again.
    assert m.lin.weight is weight and isinstance(m.lin.weight, nn.Parameter)
    assert m.shift is buffer


def test_methods_of_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @torchleaf.leaf_function
        def forward(self, x):
            return self.lin(x).relu()

    @Block.forward.register_fake
    def _(self, x):
        return x.new_empty(x.shape[0], 2)

    b = Block()
    x = torch.randn(3, 2)
    torch.testing.assert_close(b(x), b.lin(x).relu())
    # Through an instance too, as PyTorch's built-in leaf_function allows.
    assert b.forward.register_fake(lambda self, x: x.new_empty(x.shape[0], 2)) is Block.forward
    compiled = torch.compile(b, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), b.lin(x).relu())


def test_register_fake_returns_the_leaf():
    """As PyTorch's built-in leaf_function: a fake decorated under the
    leaf's own name leaves the name bound to the leaf, whose real function
    then still runs."""
    ran = []

    @torchleaf.leaf_function
    def g(x):
        ran.append("real")
        return x + 2

    @g.register_fake
    def g(x):  # noqa: F811 -- the pattern this supports
        return torch.empty_like(x)

    assert isinstance(g, torchleaf.LeafFunction)
    torch.testing.assert_close(g(torch.ones(2)), torch.full((2,), 3.0))
    torch.testing.assert_close(torch.compile(g, backend="aot_eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 3.0))
    assert ran == ["real", "real"]


def test_declared_mutation_is_visible_and_undeclared_is_an_error():
    @torchleaf.leaf_function(mutates_args={"counter"})
    def step(x, counter):
        counter.add_(1)
        return x * 2

    counter = torch.zeros(())
    x = torch.ones(2)
    torch.testing.assert_close(step(x, counter), x * 2)
    torch.testing.assert_close(step(x, counter=counter), x * 2)
    assert counter.item() == 2

    @torchleaf.leaf_function
    def sneaky(x):
        x.mul_(2)
        return x + 1

    with pytest.raises(LeafFunctionError, match=r"sneaky' mutated its input 0 \(argument 'x'\) .*mutates_args"):
        sneaky(torch.ones(2))

    with pytest.raises(LeafFunctionError, match=r"mutates_args=\['nope'\], which is not a parameter"):
        torchleaf.leaf_function(mutates_args={"nope"})(lambda x: x)


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
def test_mutates_args_expressions_name_parts_of_arguments(mode):
    """The expressions PyTorch's built-in leaf_function takes: a list item,
    a dict entry, a module's buffer (which declares the module's buffers).
    What they do not name stays checked."""

    @torchleaf.leaf_function(mutates_args={"buffers[0]", 'state["count"]', "bn.running_mean"})
    def step(x, buffers, state, bn):
        buffers[0].add_(1)
        state["count"].add_(1)
        bn.running_mean.add_(1)
        return x * 2 + buffers[1]

    step.register_fake(lambda x, buffers, state, bn: torch.empty_like(x))

    @torchleaf.leaf_function(mutates_args={"buffers[0]"})
    def sneaky(x, buffers):
        buffers[1].add_(1)
        return x * 2

    sneaky.register_fake(lambda x, buffers: torch.empty_like(x))
    if mode != "eager":
        step = torch.compile(step, backend=mode, fullgraph=True)
    buffers, state, bn = [torch.zeros(3), torch.ones(3)], {"count": torch.zeros(())}, nn.BatchNorm1d(3)
    x = torch.randn(3, requires_grad=True)
    for calls in (1, 2):
        out = step(x, buffers, state, bn)
        torch.testing.assert_close(out, x * 2 + 1)
        assert buffers[0].tolist() == [calls] * 3 and state["count"].item() == calls
        assert bn.running_mean.tolist() == [calls] * 3 and buffers[1].tolist() == [1.0] * 3
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(gx, torch.full((3,), 2.0))
    with pytest.raises(LeafFunctionError, match=r"sneaky' mutated its input 1 \(argument 'buffers\[1\]'\) .*mutates_args"):
        sneaky(x, buffers)
    @torchleaf.leaf_function(mutates_args={'state["a\\"b"]'})  # an escaped quote in the key
    def quoted(x, state):
        state['a"b'].add_(1)
        return x * 2

    quoted.register_fake(lambda x, state: torch.empty_like(x))
    counter = torch.zeros(())
    quoted(x, {'a"b': counter})
    assert counter.item() == 1
    with pytest.raises(LeafFunctionError, match=r"mutates_args entry 'buffers\[0'"):
        torchleaf.leaf_function(mutates_args={"buffers[0"})(lambda x, buffers: x)
    with pytest.raises(LeafFunctionError, match=r"step \['missing'\] does not exist"):
        torchleaf.leaf_function(mutates_args={"state['missing']"})(lambda x, state: x)(x, {"count": x})
    with pytest.raises(LeafFunctionError, match=r"step \['missing'\] does not exist .*defaultdict"):
        torchleaf.leaf_function(mutates_args={"state['missing']"})(lambda x, state: x)(
            x, collections.defaultdict(list))
    t = torch.zeros(3)
    with pytest.raises(LeafFunctionError, match=r"as argument \"state\['b'\]\", which it reads, and as argument "
                                                r"\"state\['a'\]\", which it mutates"):
        torchleaf.leaf_function(mutates_args={'state["a"]'})(lambda x, state: x)(x, {"a": t, "b": t})


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
def test_in_place_changes_under_inference_mode_bump_versions(mode):
    """Inference mode keeps version counters of normal tensors: the body's
    in-place change is an error when undeclared, and a declared one makes a
    graph that saved the tensor refuse to backpropagate, as for plain code."""

    def body(x, buf):
        buf.add_(1)
        return x * 2

    def fake(x, buf):
        return torch.empty_like(x)

    undeclared = torchleaf.leaf_function(body)
    declared = torchleaf.leaf_function(mutates_args={"buf"})(body)
    for leaf in (undeclared, declared):
        leaf.register_fake(fake)
    if mode != "eager":
        undeclared = torch.compile(undeclared, backend=mode, fullgraph=True)
        declared = torch.compile(declared, backend=mode, fullgraph=True)

    buf = torch.zeros(3)
    with torch.inference_mode(), pytest.raises(LeafFunctionError, match=r"body' mutated its input 1 \(argument 'buf'\) .*mutates_args"):
        undeclared(torch.ones(3), buf)

    w = torch.ones(3, requires_grad=True)
    buf = torch.ones(3)
    z = (w * buf).sum()  # saves buf
    with torch.inference_mode():
        torch.testing.assert_close(declared(torch.ones(3), buf), torch.full((3,), 2.0))
    assert buf._version > 0 and buf.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_validate_outputs_names_the_difference():
    @torchleaf.leaf_function
    def f(x):
        return x.sum(0), x

    @f.register_fake
    def _(x):
        return x.new_empty(x.shape[1]), x.new_empty(x.shape)

    @torchleaf.leaf_function
    def wrong_shape(x):
        return x.sum(0)

    @wrong_shape.register_fake
    def _(x):
        return torch.empty_like(x)

    @torchleaf.leaf_function
    def wrong_structure(x):
        return (x + 1, x + 2)

    @wrong_structure.register_fake
    def _(x):
        return [torch.empty_like(x), torch.empty_like(x)]

    @torchleaf.leaf_function
    def wrong_dtype(x):
        return x.double()

    @wrong_dtype.register_fake
    def _(x):
        return torch.empty_like(x)

    x = torch.ones(2, 3)
    assert torchleaf.config.validate_outputs is False
    wrong_shape(x)  # not checked by default
    with torchleaf.config.patch(validate_outputs=True):
        assert torchleaf.config.validate_outputs is True
        f(x)
        with pytest.raises(LeafFunctionError, match=r"wrong_shape' output 0 has shape \[3\] but its fake .* \[2, 3\]"):
            wrong_shape(x)
        with pytest.raises(LeafFunctionError, match=r"different output structure.*\n  real: \(Tensor, Tensor\)\n  fake: \[Tensor, Tensor\]"):
            wrong_structure(x)
        with pytest.raises(LeafFunctionError, match="has dtype Double but its fake implementation gives dtype Float"):
            wrong_dtype(x)
    assert torchleaf.config.validate_outputs is False
    # The attribute form and a per-leaf override.
    torchleaf.config.validate_outputs = True
    try:
        with pytest.raises(LeafFunctionError, match=r"wrong_shape' output 0 has shape \[3\]"):
            wrong_shape(x)
    finally:
        torchleaf.config.validate_outputs = False
    wrong_shape(x)  # the attribute form was reset: not checked again

    def strict_sum(x):
        return x.sum(0)

    strict = torchleaf.leaf_function(validate_outputs=True)(strict_sum)
    strict.register_fake(lambda x: torch.empty_like(x))
    with pytest.raises(LeafFunctionError, match=r"strict_sum' output 0 has shape \[3\] but its fake .* \[2, 3\]"):
        strict(x)
    with pytest.raises(AttributeError, match="no flag"):
        with torchleaf.config.patch(no_such_flag=True):
            pass


def test_errors_are_leaf_function_errors():
    """What torchleaf raises, from its Python layer and from its C++ core, is
    exactly torchleaf.LeafFunctionError (a RuntimeError, so `except
    RuntimeError` handlers still catch it), and the message names the leaf."""

    def declares_unknown(x):
        return x

    def closes_over(x):  # checked in C++ (capture)
        return x * w

    def mutates(x):  # checked in C++ (capture)
        x.add_(1)
        return x

    w = torch.ones(2, requires_grad=True)
    triggers = {
        "declares_unknown": lambda: torchleaf.leaf_function(mutates_args={"y"})(declares_unknown),
        "closes_over": lambda: torchleaf.leaf_function(closes_over)(torch.ones(2, requires_grad=True)),
        "mutates": lambda: torchleaf.leaf_function(mutates)(torch.ones(2)),
    }
    for name, trigger in triggers.items():
        try:
            trigger()
        except RuntimeError as e:
            error = e
        else:
            pytest.fail(f"{name}: no error")
        assert type(error) is LeafFunctionError, (name, repr(error))
        assert re.match(rf"torchleaf: leaf function '[\w.<>]*\.{name}' ", str(error)), str(error)
    assert torchleaf.live_states() == 0


def test_fake_tensors_run_the_fake_never_the_real():
    real_calls = []

    @torchleaf.leaf_function
    def f(x, y):
        real_calls.append(1)
        return x @ y

    @f.register_fake
    def _(x, y):
        return x.new_empty(x.shape[0], y.shape[1])

    with FakeTensorMode():
        out = f(torch.empty(2, 3), torch.empty(3, 5))
        assert out.shape == (2, 5)
    assert real_calls == []

    @torchleaf.leaf_function
    def no_fake(x):
        return x + 1

    with FakeTensorMode():
        with pytest.raises(LeafFunctionError, match="no_fake' requires a fake implementation"):
            no_fake(torch.empty(2))
    torch.testing.assert_close(no_fake(torch.zeros(2)), torch.ones(2))  # eager needs no fake


def test_one_named_operator_call_in_the_profiler():
    @torchleaf.leaf_function
    def profiled_leaf(x):
        return (x * 2).sin().cos()

    x = torch.randn(8)
    with torch.profiler.profile() as prof:
        profiled_leaf(x)
    names = [e.name for e in prof.events()]
    assert names.count("torchleaf::call") == 1
    assert sum(1 for n in names if n.endswith("profiled_leaf")) == 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_steps_show_one_forward_and_one_backward_in_the_profiler(backend):
    """Compiled graphs' calls skip the dispatcher's round trips
    (forward_plain, backward_plain) and still show their operators."""

    @torchleaf.leaf_function
    def profiled_step_leaf(x):
        return (x * 2).sin()

    profiled_step_leaf.register_fake(torch.empty_like)
    x = torch.randn(8, requires_grad=True)
    step = torch.compile(lambda x: profiled_step_leaf(x).sum(), backend=backend, fullgraph=True)
    step(x).backward()
    x.grad = None
    with torch.profiler.profile() as prof:
        step(x).backward()
    names = [e.name for e in prof.events()]
    assert names.count("torchleaf::forward") == 1
    assert names.count("torchleaf::backward") == 1
    torch.testing.assert_close(x.grad, 2 * (2 * x.detach()).cos())
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_inference_steps_show_one_call_in_the_profiler(backend):
    """Without gradients a compiled graph calls torchleaf::call, which the
    direct entry runs without the dispatcher (call_plain); the profiler
    still shows the operator once, and nothing is captured."""

    @torchleaf.leaf_function
    def profiled_inference_leaf(x):
        return (x * 2).sin()

    profiled_inference_leaf.register_fake(torch.empty_like)
    x = torch.randn(8)
    step = torch.compile(lambda x: profiled_inference_leaf(x) + 1, backend=backend, fullgraph=True)
    step(x)
    with torch.profiler.profile() as prof:
        out = step(x)
    names = [e.name for e in prof.events()]
    assert names.count("torchleaf::call") == 1
    assert "torchleaf::forward" not in names
    torch.testing.assert_close(out, (x * 2).sin() + 1)
    assert torchleaf.live_states() == 0


def test_exceptions_keep_their_type_and_name_the_leaf():
    class Boom(ValueError):
        pass

    @torchleaf.leaf_function
    def explode(x):
        if x.sum() > 10:
            raise Boom("too large")
        return x * 2

    x = torch.full((3,), 5.0, requires_grad=True)
    with pytest.raises(Boom, match="too large") as info:
        explode(x)
    assert any("explode" in note for note in info.value.__notes__)
    assert torchleaf.live_states() == 0
    torch.testing.assert_close(explode(torch.ones(3)), torch.full((3,), 2.0))


def test_cpp_leaf_from_python(cpp_leaves):
    ops, lib = cpp_leaves
    x, b = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(ops.scale_bias([x, b])[0], x * 2 + b)
    lib.torchleaf_test_set_scale(5.0)
    try:
        torch.testing.assert_close(ops.scale_bias([x, b])[0], x * 5 + b)
    finally:
        lib.torchleaf_test_set_scale(2.0)
    counter = torch.zeros(())
    ops.count_calls([x], [counter])
    ops.count_calls([x], [counter])
    assert counter.item() == 2
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):  # the C++ fake gets an unbacked size
        out = ops.positives([torch.empty(6)])[0]
        assert isinstance(out.shape[0], torch.SymInt)
