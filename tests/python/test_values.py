"""Everything a plain function accepts and returns, a leaf accepts and returns,
eager and compiled alike: each test compares against the undecorated
function."""

import collections
import dataclasses
import enum
import functools
import io
import math
import pickle

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.utils import parametrize

import torchleaf
from torchleaf import LeafFunctionError

COMPILED = ["aot_eager", "inductor"]


def _leaf(fn, fake):
    leaf = torchleaf.leaf_function(fn)
    leaf.register_fake(fake)
    return leaf


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dynamic", [None, True])
def test_changing_floats_reach_the_function_without_recompiling(backend, dynamic):
    torch._dynamo.reset()

    def scale(x, temperature, opts):
        return x * temperature + opts["shift"]

    leaf = _leaf(scale, lambda x, t, o: torch.empty_like(x))
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(lambda x, t, o: leaf(x, t, o), backend=counter, fullgraph=True, dynamic=dynamic)
    x = torch.randn(3)
    for step in range(4):
        t, shift = 1.0 / (step + 1), 0.5 * step
        torch.testing.assert_close(compiled(x, t, {"shift": shift}), scale(x, t, {"shift": shift}))
    assert counter.frame_count <= 2  # Dynamo may specialize the first value once


@pytest.mark.parametrize("backend", COMPILED)
def test_ints_beyond_a_size_stay_constants(backend):
    def mix(x, seed):
        return x + seed % 7

    leaf = _leaf(mix, lambda x, seed: torch.empty_like(x))
    compiled = torch.compile(lambda x: leaf(x, 2**70 + 3), backend=backend, fullgraph=True)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), mix(x, 2**70 + 3))
    compiled = torch.compile(lambda x: leaf(x, -(2**63) - 5), backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), mix(x, -(2**63) - 5))


@pytest.mark.parametrize("backend", ["eager", *COMPILED])
def test_an_int_from_item_whose_sign_the_trace_cannot_know(backend):
    """An unbacked int (.item() with capture_scalar_outputs) failed to trace
    under fullgraph=True ("Could not guard on data-dependent expression"):
    a compiled call carried an int as a size, which needs its sign. Such an
    int is now zigzag-coded; one graph serves negative, zero and positive
    values."""
    # config.patch, not monkeypatch: pytest 9.2's monkeypatch.undo deletes
    # the attribute from the config module (which keeps values elsewhere).
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _check_an_int_from_item(backend)


def _check_an_int_from_item(backend):
    torch._dynamo.reset()

    def shift(x, n):
        return x + n

    leaf = _leaf(shift, lambda x, n: torch.empty_like(x))

    def program(fn, x, y):
        return fn(x, (y > 0).sum().item() - 2) * 2

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(functools.partial(program, leaf), backend=counter, fullgraph=True)
    x = torch.randn(3)
    for y in ([-1.0, -1.0, -1.0], [1.0, -1.0, -1.0], [1.0, 1.0, -1.0], [1.0, 1.0, 1.0]):
        y = torch.tensor(y)
        torch.testing.assert_close(compiled(x, y), program(shift, x, y))
    assert counter.frame_count == 1


Pair = collections.namedtuple("Pair", "low high")


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_namedtuple_outputs(backend):
    def split(x):
        return Pair(x.clamp(max=0), x.clamp(min=0) * 2)

    leaf = _leaf(split, lambda x: Pair(torch.empty_like(x), torch.empty_like(x)))
    run = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    x = torch.randn(5, requires_grad=True)
    out = run(x)
    assert type(out) is Pair
    expected = split(x)
    torch.testing.assert_close(tuple(out), tuple(expected))
    g = torch.autograd.grad(out.high.sum() + out.low.sum(), x)[0]
    torch.testing.assert_close(g, torch.autograd.grad(expected.high.sum() + expected.low.sum(), x)[0])


@pytest.mark.slow
def test_a_fake_describes_the_copy_of_an_aliasing_output():
    """An output that is a view of another output is returned as a copy,
    laid out as clone() lays it out; Inductor relies on the fake's strides,
    and a fake that describes the view rather than the copy is told so."""
    torch._dynamo.reset()

    def head_and_tail(x):
        y = x * 2
        return y, y[:, 1:]

    x = torch.randn(3, 4)
    like_the_copy = _leaf(head_and_tail, lambda x: (torch.empty_like(x), x.new_empty(3, 3)))
    got = torch.compile(lambda x: like_the_copy(x), backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(got, head_and_tail(x))
    assert got[1].stride() == (3, 1)
    like_the_view = _leaf(head_and_tail, lambda x: (torch.empty_like(x), torch.empty_like(x)[:, 1:]))
    with pytest.raises(LeafFunctionError, match=r"view of an input or of another output is returned as a copy"):
        torch.compile(lambda x: like_the_view(x), backend="inductor", fullgraph=True)(x)


@pytest.mark.parametrize("backend", COMPILED)
def test_int_outputs_that_change_between_calls(backend):
    """An int output whose fake returns a SymInt (a size of a dynamic input,
    or an unbacked size for a data-dependent count) is each call's own int,
    negative ones included, without recompiling; a fake's plain int stays a
    graph constant."""
    torch._dynamo.reset()

    def sizes(x):
        return x.sin(), x.shape[0], -x.shape[0]

    def count(x):
        n = int((x > 0).sum())
        return x * 2, n, -n

    def unbacked(x):
        n = torch.library.get_ctx().new_dynamic_size()
        return torch.empty_like(x), n, -n

    def use(f, x):
        y, n, m = f(x)
        return y.sum() * n + m, n, m

    for fn, fake in ((sizes, lambda x: (torch.empty_like(x), x.shape[0], -x.shape[0])), (count, unbacked)):
        leaf = _leaf(fn, fake)
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(lambda x: use(leaf, x), backend=counter, fullgraph=True, dynamic=True)
        for b in (3, 4, 6):
            x = torch.randn(b, dtype=torch.float64, requires_grad=True)
            got, expected = compiled(x), use(fn, x)
            assert got[1:] == expected[1:] and all(type(v) is int for v in got[1:])
            torch.testing.assert_close(got[0], expected[0])
            torch.testing.assert_close(torch.autograd.grad(got[0], x), torch.autograd.grad(expected[0], x))
        assert counter.frame_count == 1
    assert torchleaf.live_states() == 0

    # An int whose sign depends on the size: traces that specialize a size
    # (0 and 1, or a size making it 0) return a plain int where the dynamic
    # trace returned a SymInt; every graph of the call structure still gets
    # its carrier.
    leaf = _leaf(lambda x: (x * 2, x.shape[0] - 3), lambda x: (torch.empty_like(x), x.shape[0] - 3))
    compiled = torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True, dynamic=True)
    for b in (2, 5, 3, 1, 9, 2):
        y, n = compiled(torch.ones(b))
        assert n == b - 3
        torch.testing.assert_close(y, torch.full((b,), 2.0))


@pytest.mark.parametrize("backend", [*COMPILED, "make_fx"])
def test_a_fake_whose_int_expression_is_wrong_is_an_error(backend):
    """Compiled code computes an int output from the fake's expression of
    the inputs' sizes, not from the function's int: a fake whose expression
    differs is an error naming the leaf and both ints, never the fake's
    value returned silently. Size-coded and zigzag-coded ints alike."""
    torch._dynamo.reset()
    from torch.fx.experimental.proxy_tensor import make_fx

    def count(x):
        return x * 2, x.shape[0] + 1

    def offset(x):
        return x * 2, x.shape[0] - 5

    cases = (
        (count, lambda x: x.shape[0], "returned the int 5 where its fake implementation returned 4"),
        (offset, lambda x: x.shape[0] - 4, "returned the int -1 where its fake implementation returned 0"),
    )
    for fn, fake_int, message in cases:
        wrong = _leaf(fn, lambda x, fake_int=fake_int: (torch.empty_like(x), fake_int(x)))
        right = _leaf(fn, lambda x, fn=fn: (torch.empty_like(x), fn(x)[1]))
        for leaf in (wrong, right):
            use = _summed_times_int(leaf)
            if backend == "make_fx":
                compiled = make_fx(use, tracing_mode="symbolic")(torch.randn(3))
            else:
                compiled = torch.compile(use, backend=backend, fullgraph=True, dynamic=True)
            x = torch.randn(4)
            if leaf is wrong and (backend != "make_fx" or fn is count):
                with pytest.raises(LeafFunctionError, match=rf"'{wrong._name}' {message}"):
                    compiled(x)
            else:
                # (make_fx's graph reads a zigzag-coded int from the real
                # carrier: the function's int, whatever the fake's.)
                torch.testing.assert_close(compiled(x), _summed_times_int(fn)(x))


@pytest.mark.parametrize("backend", [*COMPILED, "make_fx"])
def test_a_fake_whose_symbolic_size_is_wrong_is_an_error(backend):
    """With dynamic shapes, compiled code takes an output's size from the
    fake's expression (x.shape[0]) where the function returns another
    (x.shape[0] - 1): an error naming the leaf and both shapes, never the
    fake's size used silently (aot_eager and make_fx; Inductor asserts the
    size itself, naming the operator); a right fake passes."""
    torch._dynamo.reset()
    from torch.fx.experimental.proxy_tensor import make_fx

    def tail(x):
        return x[1:] * 2

    def mean_of(leaf):
        def use(x):
            y = leaf(x)
            return y.sum() / y.shape[0]

        return use

    wrong = _leaf(tail, torch.empty_like)
    right = _leaf(tail, lambda x: x.new_empty(x.shape[0] - 1))
    for leaf in (wrong, right):
        if backend == "make_fx":
            compiled = make_fx(mean_of(leaf), tracing_mode="symbolic")(torch.randn(3))
        else:
            compiled = torch.compile(mean_of(leaf), backend=backend, fullgraph=True, dynamic=True)
        x = torch.randn(5)
        if leaf is right:
            torch.testing.assert_close(compiled(x), mean_of(tail)(x))
        elif backend == "inductor":
            with pytest.raises(AssertionError, match=r"expected size 4==5"):
                compiled(x)
        else:
            with pytest.raises(LeafFunctionError, match=rf"'{wrong._name}' output 0 has shape \[4\] but its "
                               rf"fake implementation returned shape \[5\]"):
                compiled(x)


def _summed_times_int(leaf):
    def use(x):
        y, n = leaf(x)
        return y.sum() * n

    return use


class _Record(dict):
    def total(self):
        return sum(v.sum() for v in self.values())


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_outputs_keep_their_container_types(backend):
    """OrderedDict, defaultdict (with its factory), dict subclasses,
    structseqs (torch.max's result) and torch.Size come back as themselves."""
    torch._dynamo.reset()

    def containers(x):
        ordered = collections.OrderedDict([("b", x * 2), ("a", x + 1)])
        counts = collections.defaultdict(list, {"sq": x * x})
        return ordered, counts, _Record(y=x.exp()), x.reshape(2, 3).max(0), x.shape

    def fake(x):
        e = torch.empty_like(x)
        top = x.new_empty(3)
        return (collections.OrderedDict([("b", e), ("a", torch.empty_like(x))]),
                collections.defaultdict(list, {"sq": torch.empty_like(x)}),
                _Record(y=torch.empty_like(x)),
                torch.return_types.max((top, top.long())), x.shape)

    leaf = _leaf(containers, fake)
    counter = CompileCounterWithBackend(backend or "eager")
    run = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=counter, fullgraph=True)
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        run(x)  # the types' table guards compiled calls: no recompile
    assert counter.frame_count == (0 if backend is None else 1)
    got, expected = run(x), containers(x)
    assert [type(v) for v in got] == [type(v) for v in expected]
    ordered, counts, record, top, shape = got
    assert list(ordered) == ["b", "a"] and counts.default_factory is list and counts["new"] == []
    assert shape == torch.Size([6])
    torch.testing.assert_close((ordered["b"], ordered["a"], counts["sq"], record["y"], top.values, top.indices),
                               (expected[0]["b"], expected[0]["a"], expected[1]["sq"], expected[2]["y"],
                                expected[3].values, expected[3].indices))
    loss = lambda out: out[0]["b"].sum() + out[1]["sq"].sum() + out[2].total() + out[3].values.sum()
    torch.testing.assert_close(torch.autograd.grad(loss(got), x), torch.autograd.grad(loss(expected), x))


class _Tagged(dict):
    def __init__(self, tag, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_containers_not_rebuilt_exactly_come_back_plain(backend):
    """A container that calling its type on its items would not rebuild (a
    Counter, a constructor of its own, a defaultdict whose factory is a
    lambda made per call) comes back as a plain dict or tuple with the right
    items, eager and compiled alike, never emptied or with a stale factory."""
    torch._dynamo.reset()

    def containers(x):
        k = x.sum()
        return (_Tagged("t", y=x * 2), collections.Counter(a=3, b=1),
                collections.defaultdict(lambda: k, {"q": x + 1}))

    def fake(x):
        return (_Tagged("t", y=torch.empty_like(x)), collections.Counter(a=3, b=1),
                collections.defaultdict(lambda: 0.0, {"q": torch.empty_like(x)}))

    leaf = _leaf(containers, fake)
    run = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    for x in (torch.tensor([1.0, 2.0]), torch.tensor([5.0, 5.0])):
        tagged, counts, defaults = run(x)
        assert [type(v) for v in (tagged, counts, defaults)] == [dict, dict, dict]
        torch.testing.assert_close(tagged, {"y": x * 2})
        assert counts == {"a": 3, "b": 1}
        torch.testing.assert_close(defaults, {"q": x + 1})


@dataclasses.dataclass
class _Prediction:
    scores: torch.Tensor
    count: int


torch.utils._pytree.register_dataclass(_Prediction)


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_registered_pytree_outputs(backend):
    """Outputs of other registered pytree types (a registered dataclass, a
    deque) are rebuilt by their own unflatten function."""
    torch._dynamo.reset()

    def predict(x):
        return _Prediction(x.softmax(0), 3), collections.deque([x * 2], maxlen=4)

    leaf = _leaf(predict, lambda x: (_Prediction(torch.empty_like(x), 3),
                                     collections.deque([torch.empty_like(x)], maxlen=4)))
    run = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (prediction, recent), expected = run(x), predict(x)
    assert type(prediction) is _Prediction and prediction.count == 3
    assert type(recent) is collections.deque and recent.maxlen == 4
    torch.testing.assert_close((prediction.scores, recent[0]), (expected[0].scores, expected[1][0]))
    loss = lambda p, r: (p.scores * x).sum() + r[0].sum()
    torch.testing.assert_close(torch.autograd.grad(loss(prediction, recent), x),
                               torch.autograd.grad(loss(*expected), x))


def test_a_registered_pytree_context_mismatch_shows_both_contexts():
    leaf = _leaf(lambda x: collections.deque([x * 2], maxlen=3),
                 lambda x: collections.deque([torch.empty_like(x)], maxlen=2))
    with pytest.raises(LeafFunctionError, match=r"real: deque\(Tensor\): collections.deque with context 3\n"
                                                r"  fake: deque\(Tensor\): collections.deque with context 2"):
        torch.compile(leaf, backend="aot_eager", fullgraph=True)(torch.ones(2))


def test_inference_tensors():
    def double(x):
        return x * 2

    leaf = _leaf(double, torch.empty_like)
    with torch.inference_mode():
        made = torch.ones(3)
        torch.testing.assert_close(leaf(made), double(made))  # inside inference mode
    torch.testing.assert_close(leaf(made), double(made))  # used outside it


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 2.0

    @torchleaf.leaf_function
    def act(self, x):
        return torch.where(x > 0, x, x * 0.1) * self.scale

    def forward(self, x):
        return self.act(self.lin(x))


_Block.act.register_fake(lambda self, x: torch.empty_like(x))


@pytest.mark.parametrize("mode", ["eager", "compiled_function", "compiled_module"])
def test_a_leaf_used_as_a_method(mode):
    torch._dynamo.reset()
    block = _Block().double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    if mode == "eager":
        run = block
    elif mode == "compiled_function":
        run = torch.compile(lambda x: block(x), backend="aot_eager", fullgraph=True)
    else:
        run = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = run(x)
    grads = torch.autograd.grad(got.sum(), [x, *block.parameters()])
    h = block.lin(x)
    expected = torch.where(h > 0, h, h * 0.1) * block.scale
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, torch.autograd.grad(expected.sum(), [x, *block.parameters()])):
        torch.testing.assert_close(g, e)
    block.scale = 3.0  # read at run time
    torch.testing.assert_close(run(x), torch.where(h > 0, h, h * 0.1) * 3.0)


def test_decorating_what_is_not_a_function():
    with pytest.raises(LeafFunctionError, match=r"decorates a function or a method, not a int \(3\)"):
        torchleaf.leaf_function(3)
    with pytest.raises(LeafFunctionError, match=r"decorates a function or a method, not the class _Block"):
        torchleaf.leaf_function(_Block)
    # Builtins and partials are functions.
    sine = _leaf(torch.sin, torch.empty_like)
    times3 = _leaf(functools.partial(torch.mul, other=3.0), torch.empty_like)
    x = torch.randn(3)
    for leaf, fn in ((sine, torch.sin), (times3, lambda x: x * 3.0)):
        torch.testing.assert_close(leaf(x), fn(x))
        torch.testing.assert_close(torch.compile(lambda x: leaf(x), backend="aot_eager", fullgraph=True)(x), fn(x))
    assert "partial" in repr(times3)


def _through(x, m):
    return m(x)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_modules_with_tied_parameters_and_the_same_module_twice(backend):
    torch._dynamo.reset()
    lin = nn.Linear(3, 3).double()
    tied = nn.Sequential(lin, nn.Tanh(), lin)
    through = _leaf(_through, lambda x, m: torch.empty_like(x))

    def twice(x, a, b):
        return a(x) + b(x).tanh()

    both = _leaf(twice, lambda x, a, b: torch.empty_like(x))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for leaf, fn, args in ((through, _through, (tied,)), (both, twice, (lin, lin))):
        run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
        got = run(x, *args)
        grads = torch.autograd.grad(got.sum(), [x, *lin.parameters()])
        expected = fn(x, *args)
        torch.testing.assert_close(got, expected)
        for g, e in zip(grads, torch.autograd.grad(expected.sum(), [x, *lin.parameters()])):
            torch.testing.assert_close(g, e)


@torchleaf.leaf_function
def _module_level_gate(x, head):
    return head(x).sigmoid()


_module_level_gate.register_fake(lambda x, head: x.new_empty(x.shape[0], head.out_features))


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.gate = _module_level_gate

    def forward(self, x):
        return self.gate(x, self.head)


def test_models_holding_a_leaf_pickle_and_save():
    model = _Gated()
    x = torch.randn(2, 3)
    model(x)  # the head now carries a handle, which must not travel
    clone = pickle.loads(pickle.dumps(model))
    assert clone.gate is _module_level_gate  # by reference, like a function
    torch.testing.assert_close(clone(x), model(x))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x))
    compiled = torch.compile(loaded, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4).double()
        self.head = nn.Linear(4, 5, bias=False).double()
        self.head.weight = self.emb.weight  # tied across two modules

    def forward(self, tokens):
        return self.head(self.emb(tokens).tanh())


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_weights_tied_across_modules(backend):
    torch._dynamo.reset()
    lm = _TiedLM()
    weight = lm.emb.weight
    leaf = _leaf(_through, lambda t, m: torch.empty(t.shape[0], 5, dtype=torch.float64))
    run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
    tokens = torch.tensor([1, 3, 3])
    got = torch.autograd.grad(run(tokens, lm).sum(), weight)[0]
    expected = torch.autograd.grad(lm(tokens).sum(), weight)[0]
    torch.testing.assert_close(got, expected)
    assert lm.emb.weight is weight and lm.head.weight is weight  # the module is left as it was


class _Doubled(nn.Module):
    def forward(self, w):
        return w * 2


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_changes_to_a_module_between_calls_are_seen(backend):
    # A module's walk is kept between calls and re-checked by identity: every
    # way of changing what a module holds must reach the next call.
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    leaf = _leaf(_through, lambda x, m: torch.empty_like(x))
    run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def check():
        got = run(x, model)
        expected = model(x)
        torch.testing.assert_close(got, expected)
        params = list(model.parameters())
        for g, e in zip(torch.autograd.grad(got.sum(), [x, *params]), torch.autograd.grad(expected.sum(), [x, *params])):
            torch.testing.assert_close(g, e)

    check()
    model[0] = nn.Linear(3, 3).double()  # a submodule replaced
    check()
    model[2].weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))  # a parameter replaced
    check()
    model[2]._parameters["bias"] = nn.Parameter(torch.randn(3, dtype=torch.float64))  # behind PyTorch's back
    check()
    with torch.no_grad():
        model[0].weight.mul_(2)  # data changed in place, outside the leaf
    check()
    # Structure changes (a recompile under torch.compile, whose fake runs on
    # a module of the new structure: this one, filed under it again).
    model[2].bias = None
    check()
    model.append(nn.Linear(3, 3).double())
    check()
    model[0].register_buffer("scale", torch.ones(3, dtype=torch.float64))
    check()
    parametrize.register_parametrization(model[0], "weight", _Doubled())
    check()


def test_modules_the_walk_cannot_place_are_bound_by_name(monkeypatch):
    # The fallback for modules whose parameters a walk of named_modules does
    # not find under their names (an overridden named_parameters).
    from torchleaf import _modules as modules

    walk = modules.ModuleView.__init__

    def cannot_place(self, module):
        walk(self, module)
        self.slot_dicts = None

    monkeypatch.setattr(modules.ModuleView, "__init__", cannot_place)
    test_modules_with_tied_parameters_and_the_same_module_twice(None)
    test_changes_to_a_module_between_calls_are_seen(None)
    test_weights_tied_across_modules(None)
    test_undeclared_in_place_change_of_a_module_buffer_names_it(None)
    with pytest.raises(LeafFunctionError, match=r"replaced 'weight' of its Linear argument"):
        torchleaf.leaf_function(lambda m, x: setattr(m, "weight", nn.Parameter(m.weight * 0)) or m(x))(
            nn.Linear(2, 2), torch.ones(1, 2))


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_submodule_reassigned_inside_the_leaf_is_an_error(backend):
    # The error names the first parameter that moved, and the module is left
    # as it was: its own submodules, in their places.
    def swaps(x, m):
        m[0] = nn.Linear(3, 3)
        return m(x)

    def deletes(x, m):
        del m[0]  # (Sequential renumbers: a new _modules dict)
        return m(x)

    for fn in (swaps, deletes):
        torch._dynamo.reset()
        model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        first, second = model[0], model[1]
        leaf = _leaf(fn, lambda x, m: torch.empty_like(x))
        run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
        with pytest.raises(LeafFunctionError, match=r"replaced '0\.weight' of its Sequential argument"):
            run(torch.randn(2, 3), model)
        assert list(model) == [first, second]
        assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias"]
        assert model[0].weight is first.weight
        assert torchleaf.live_states() == 0


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_a_leaf_may_add_state_to_its_module_argument(backend):
    # A buffer or a child without parameters, added lazily inside the body,
    # changes no parameter the call was given: no error, and later calls take
    # the module as it is now.
    torch._dynamo.reset()

    def counted(m, x):
        if not hasattr(m, "calls"):
            m.register_buffer("calls", torch.zeros((), dtype=torch.int64))
            m.tap = nn.Identity()
        return m.tap(m(x)) * 2

    leaf = _leaf(counted, lambda m, x: torch.empty(x.shape[0], 3, dtype=x.dtype))
    run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
    model = nn.Linear(3, 3).double()
    weight = model.weight
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        got = run(model, x)
        expected = model(x) * 2
        torch.testing.assert_close(got, expected)
        for g, e in zip(torch.autograd.grad(got.sum(), [x, weight]), torch.autograd.grad(expected.sum(), [x, weight])):
            torch.testing.assert_close(g, e)
    assert [name for name, _ in model.named_buffers()] == ["calls"]
    assert model.weight is weight
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_a_module_has_its_own_tensors_after_a_leaf_raises_or_replaces_one(backend):
    # The call's tensors are written into the module's dicts for the body and
    # taken out again however the body ends.
    torch._dynamo.reset()
    block = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)).double()
    own = {name: t for name, t in block.named_parameters()}

    def raises(m, x):
        m(x)
        raise ValueError("from the body")

    def replaces(m, x):
        m[0].weight = nn.Parameter(m[0].weight * 2)
        return m(x)

    def deletes(m, x):
        out = m(x)
        del m[1].bias
        return out

    def replaces_then_raises(m, x):
        m[0].weight = nn.Parameter(m[0].weight * 2)
        raise ValueError("after replacing")

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for fn, error, match in ((raises, ValueError, "from the body"),
                             (replaces, LeafFunctionError, r"replaced '0\.weight' of its Sequential argument"),
                             (deletes, LeafFunctionError, r"replaced '1\.bias' of its Sequential argument"),
                             (replaces_then_raises, ValueError, "after replacing")):
        leaf = _leaf(fn, lambda m, x: torch.empty_like(x))
        run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
        with pytest.raises(error, match=match):
            run(block, x)
        assert [name for name, _ in block.named_parameters()] == list(own)
        assert all(own[name] is t for name, t in block.named_parameters())
    assert torchleaf.live_states() == 0
    good = _leaf(_through_first, lambda m, x: torch.empty_like(x))
    torch.testing.assert_close(good(block, x), block(x))


def _through_first(m, x):
    return m(x)


def test_a_leaf_calling_a_leaf_with_the_same_module():
    inner = _leaf(_through, lambda x, m: torch.empty_like(x))
    outer = _leaf(lambda x, m: inner(x, m) * 2 + m(x), lambda x, m: torch.empty_like(x))
    model = nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        got = outer(x, model)
        expected = model(x) * 3
        torch.testing.assert_close(got, expected)
        for g, e in zip(torch.autograd.grad(got.sum(), [x, *model.parameters()]),
                        torch.autograd.grad(expected.sum(), [x, *model.parameters()])):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_a_module_and_its_submodule_in_one_call(backend):
    """Both set the submodule's parameters for the call; the one entered
    last puts back what the first had set, which is not the module's own."""
    torch._dynamo.reset()

    def both(x, a, b):
        return a(x) + b(x)

    def in_a_list(x, modules):
        return modules[0](x) * modules[1](x)

    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    weight = model[0].weight
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for fn, args in (
        (both, (model, model[0])),
        (both, (model[0], model)),
        (in_a_list, ([model, model[0]],)),
    ):
        leaf = _leaf(fn, lambda x, *rest: torch.empty_like(x))
        run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
        got = run(x, *args)
        expected = fn(x, *args)
        torch.testing.assert_close(got, expected)
        params = [x, *model.parameters()]
        for g, e in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(expected.sum(), params)):
            torch.testing.assert_close(g, e)
        assert model[0].weight is weight  # the module is left as it was


@torchleaf.leaf_function(mutates_args={"bn"})
def _normalize(x, bn):
    return bn(x).relu()


_normalize.register_fake(lambda x, bn: torch.empty_like(x))


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_module_buffers_declared_mutable_batchnorm_in_train_mode(backend):
    torch._dynamo.reset()
    bn, reference = nn.BatchNorm1d(3).double(), nn.BatchNorm1d(3).double()
    reference.load_state_dict(bn.state_dict())
    run = _normalize if backend is None else torch.compile(_normalize, backend=backend, fullgraph=True)
    for step in range(3):
        x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
        got = run(x, bn)
        expected = reference(x).relu()
        torch.testing.assert_close(got, expected)
        grads = torch.autograd.grad(got.sum(), [x, bn.weight, bn.bias])
        for g, e in zip(grads, torch.autograd.grad(expected.sum(), [x, reference.weight, reference.bias])):
            torch.testing.assert_close(g, e)
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert bn.num_batches_tracked.item() == reference.num_batches_tracked.item() == 3


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_module_with_buffers_only_declared_mutable(backend):
    # No parameters: its buffers must still be the mutable part (they were
    # counted as parameters, and BatchNorm's update was undeclared mutation).
    torch._dynamo.reset()
    bn, reference = nn.BatchNorm1d(3, affine=False).double(), nn.BatchNorm1d(3, affine=False).double()
    run = _normalize if backend is None else torch.compile(_normalize, backend=backend, fullgraph=True)
    for _ in range(2):
        x = torch.randn(8, 3, dtype=torch.float64)
        torch.testing.assert_close(run(x, bn), reference(x).relu())
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    assert bn.num_batches_tracked.item() == 2


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_undeclared_in_place_change_of_a_module_buffer_names_it(backend):
    torch._dynamo.reset()
    bn = nn.BatchNorm1d(3)
    leaf = _leaf(lambda x, bn: bn(x), lambda x, bn: torch.empty_like(x))
    run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
    buffers = dict(bn.named_buffers())
    with pytest.raises(LeafFunctionError, match=r"changed '(running_mean|running_var|num_batches_tracked)' of its "
                       r"BatchNorm1d argument in place without declaring it\. Name that argument in mutates_args"):
        run(torch.randn(4, 3), bn)
    assert torchleaf.live_states() == 0
    assert all(t is buffers[name] for name, t in bn.named_buffers())
    bn.eval()  # eval mode changes nothing: fine
    torch.testing.assert_close(run(torch.ones(4, 3), bn), bn(torch.ones(4, 3)))


@pytest.mark.parametrize("backend", COMPILED)
def test_channels_last_inputs(backend):
    torch._dynamo.reset()

    def act(x):
        return x.relu() * 2

    leaf = _leaf(act, torch.empty_like)
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    compiled = torch.compile(lambda x: leaf(x).sum(), backend=backend, fullgraph=True)
    got = torch.autograd.grad(compiled(x), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(act(x).sum(), x)[0])


@pytest.mark.parametrize("backend", COMPILED)
def test_unbacked_output_size_with_gradients(backend):
    torch._dynamo.reset()

    def positives(x):
        return x[x > 0] * 2

    def fake(x):
        return x.new_empty(torch.library.get_ctx().new_dynamic_size())

    leaf = _leaf(positives, fake)
    x = torch.randn(8, requires_grad=True)
    compiled = torch.compile(lambda x: leaf(x).sum(), backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), positives(x).sum())
    got = torch.autograd.grad(compiled(x), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(positives(x).sum(), x)[0])


@dataclasses.dataclass
class _Cfg:
    scale: float
    x: torch.Tensor
    shift: Pair = None


torch.utils._pytree.register_dataclass(_Cfg)


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_registered_dataclass_arguments(backend):
    # Compiled calls pass the call's structure to Dynamo as builtins: a user
    # object (the dataclass) cannot be a graph constant.
    torch._dynamo.reset()

    def scaled(cfg, y):
        out = cfg.x * cfg.scale + y
        return out if cfg.shift is None else out + cfg.shift.low * cfg.shift.high

    leaf = _leaf(scaled, lambda cfg, y: torch.empty_like(cfg.x))
    counter = CompileCounterWithBackend(backend or "eager")
    run = leaf if backend is None else torch.compile(lambda c, y: leaf(c, y=y), backend=counter, fullgraph=True)
    for step in range(4):
        x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        y = torch.randn(3, dtype=torch.float64, requires_grad=True)
        shift = Pair(x, 0.5 * step) if step >= 2 else None  # a second structure, nested
        cfg = _Cfg(scale=1.0 / (step + 1), x=x, shift=shift)  # a float that changes every step
        got, expected = run(cfg, y), scaled(cfg, y)
        torch.testing.assert_close(got, expected)
        grads = torch.autograd.grad(got.sum(), [x, y])
        for g, e in zip(grads, torch.autograd.grad(expected.sum(), [x, y])):
            torch.testing.assert_close(g, e)
    if backend is not None:
        assert counter.frame_count <= 4  # per structure, at most once more to make the float dynamic


def _read_and_bump(x, buf):
    buf.add_(1)
    return x * 2


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_a_tensor_read_and_declared_mutable_is_a_clear_error(backend):
    # Eagerly the read-only argument would see the mutation (the core reported
    # it as undeclared), in a graph it would not (the mutation runs on a copy).
    torch._dynamo.reset()
    leaf = torchleaf.leaf_function(mutates_args={"buf"})(_read_and_bump)
    leaf.register_fake(lambda x, buf: torch.empty_like(x))
    run = leaf if backend is None else torch.compile(lambda x, b: leaf(x, b), backend=backend, fullgraph=True)
    t = torch.zeros(4)
    for x, buf in ((t, t), (t.view(2, 2), t), (t[1], t.view(2, 2))):
        with pytest.raises(Exception, match=r"got the same tensor \(or views of one tensor\) as argument 'x', "
                           r"which it reads, and as argument 'buf', which it mutates") as info:
            run(x, buf)
        cause = info.value
        while not isinstance(cause, LeafFunctionError) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__
        assert isinstance(cause, LeafFunctionError)
    assert (t == 0).all()  # refused before running
    x = t.clone()
    torch.testing.assert_close(run(x, t), _read_and_bump(x, torch.zeros(4)))
    torch.testing.assert_close(t, torch.ones(4))


@pytest.mark.parametrize("backend", [None, *COMPILED])
@pytest.mark.parametrize("body", ["identity", "view", "select"])
def test_outputs_are_never_aliases_of_inputs(backend, body):
    # The rule (as for torch.library.custom_op, where aliasing is an error):
    # an output that would alias an input is a copy, eager and compiled alike,
    # so changing it in place leaves the input as it was.
    torch._dynamo.reset()
    fn = {"identity": lambda x: x, "view": lambda x: x.view(-1), "select": lambda x: x[0]}[body]
    leaf = _leaf(fn, lambda x: torch.empty_like(fn(x)))
    run = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    x = torch.randn(2, 3, requires_grad=True)
    out = run(x)
    torch.testing.assert_close(out, fn(x))
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(fn(x).sum(), x)[0])
    before = x.detach().clone()
    with torch.no_grad():
        out.add_(1)
    torch.testing.assert_close(x.detach(), before)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", [None, *COMPILED])
def test_outputs_that_do_not_depend_on_the_inputs(backend):
    # Eagerly such an output does not require grad, as with the plain function;
    # a compiled graph (AOTAutograd, as for custom_op) marks every float output
    # of the call differentiable, and its gradient to the inputs is zero.
    torch._dynamo.reset()

    def with_constant(x):
        return x * 2, torch.ones(3)

    leaf = _leaf(with_constant, lambda x: (torch.empty_like(x), torch.empty(3)))
    run = leaf if backend is None else torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    x = torch.randn(3, requires_grad=True)
    doubled, ones = run(x)
    expected = with_constant(x)
    torch.testing.assert_close((doubled, ones), expected)
    assert ones.requires_grad == (backend is not None)
    if backend is not None:
        torch.testing.assert_close(torch.autograd.grad(ones.sum(), x, retain_graph=True)[0], torch.zeros(3))
    got = torch.autograd.grad(doubled.sum() + ones.sum(), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(expected[0].sum() + expected[1].sum(), x)[0])

# A wrong fake with validation off: every real call of a traced graph is
# checked against what the fake gave when the graph was traced (rank, sizes,
# dtype, device, strides), which used to be silent garbage under aot_eager
# or an Inductor assert that names no leaf.
# {case: (real function, a correct fake, the error with torch.empty_like as the fake)}
WRONG_FAKES = {
    "rank": (
        lambda x: x.sum(0),
        lambda x: x.new_empty(x.shape[1]),
        r"output 0 has 1-d shape \[3\] but the fake implementation returned 2-d shape \[2, 3\]",
    ),
    "shape": (
        lambda x: torch.cat([x, x]),
        lambda x: x.new_empty(2 * x.shape[0], x.shape[1]),
        r"output 0 has shape \[4, 3\] but the fake implementation returned shape \[2, 3\]",
    ),
    "dtype": (
        lambda x: x.double(),
        lambda x: torch.empty_like(x, dtype=torch.float64),
        r"output 0 has dtype Double but the fake implementation returned dtype Float",
    ),
}


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("wrong", sorted(WRONG_FAKES))
def test_a_wrong_fake_is_named_on_compiled_calls(backend, requires_grad, wrong):
    torch._dynamo.reset()
    real, correct_fake, message = WRONG_FAKES[wrong]
    leaf = _leaf(real, torch.empty_like)
    compiled = torch.compile(lambda x: leaf(x) * 2, backend=backend, fullgraph=True)
    x = torch.randn(2, 3, requires_grad=requires_grad)
    with pytest.raises(LeafFunctionError, match=r"leaf function '.*<lambda>' " + message + r" when the graph was "
                       r"traced\. .*Fix the fake implementation"):
        compiled(x)
    assert torchleaf.live_states() == 0
    # The same leaf still runs eagerly (nothing traced there); with a correct
    # fake it compiles. (A new leaf: Inductor's graph cache keys on the graph,
    # which does not show the fake's output dtype.)
    torch.testing.assert_close(leaf(x), real(x))
    leaf = _leaf(real, correct_fake)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: leaf(x) * 2, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), real(x) * 2)


@pytest.mark.parametrize("backend", COMPILED)
def test_a_fake_with_the_wrong_strides_is_named_where_the_graph_relies_on_them(backend):
    torch._dynamo.reset()
    real = lambda x: x.relu() * 2  # noqa: E731  (channels_last in, channels_last out)
    leaf = _leaf(real, lambda x: torch.empty(x.shape))
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    compiled = torch.compile(lambda x: leaf(x) + 1, backend=backend, fullgraph=True)
    if backend == "inductor":  # which asserts the strides of the leaf's outputs
        with pytest.raises(LeafFunctionError, match=r"output 0 has strides \[48, 1, 12, 3\] \(shape \[2, 3, 4, 4\]\) "
                           r"but the fake implementation returned strides \[48, 16, 4, 1\]"):
            compiled(x)
    else:  # aot_eager runs with whatever layout comes back
        torch.testing.assert_close(compiled(x), real(x) + 1)


@pytest.mark.slow
def test_a_layout_traced_second_is_checked_against_its_own_trace():
    """A fake that is right for channels_last inputs and wrong for contiguous
    ones (the body's channels_last weight makes every output channels_last).
    Traced first with channels_last, then recompiled for a contiguous input:
    the first trace's record (only sizes match) used to accept the call and
    Inductor's own stride assert fired, naming no leaf."""
    torch._dynamo.reset()
    weight = torch.randn(3, 3, 1, 1).to(memory_format=torch.channels_last)
    leaf = _leaf(lambda x: torch.nn.functional.conv2d(x, weight), torch.empty_like)
    compiled = torch.compile(lambda x: leaf(x * 2).sum(), backend="inductor", fullgraph=True)
    x = torch.randn(2, 3, 4, 4)
    compiled(x.to(memory_format=torch.channels_last))  # right for this layout
    with pytest.raises(LeafFunctionError, match=r"output 0 has strides \[48, 1, 12, 3\] \(shape \[2, 3, 4, 4\]\) "
                       r"but the fake implementation returned strides \[48, 16, 4, 1\]"):
        compiled(x)


@pytest.mark.parametrize("backend", COMPILED)
def test_correct_fakes_pass_the_check_with_dynamic_and_changing_shapes(backend):
    torch._dynamo.reset()

    def head(x, n):
        return x[:n].t() * 2, x.sum(1).long()

    def fake(x, n):  # the first output is a transposed (column-major) tensor, as the real one
        return x.new_empty(min(n, x.shape[0]), x.shape[1]).t(), x.new_empty(x.shape[0], dtype=torch.long)

    leaf = _leaf(head, fake)
    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, n: leaf(x, n), backend=backend, fullgraph=True, dynamic=dynamic)
        for rows, n in ((4, 2), (5, 3), (6, 3), (4, 2), (7, 7)):
            x = torch.randn(rows, 3)
            for got, expected in zip(compiled(x, n), head(x, n)):
                torch.testing.assert_close(got, expected)


class _Mode(enum.Enum):
    SCALE = 2.0
    SHIFT = 3.0


class _Settings:
    """A plain config object (hashable by identity), as users pass."""

    def __init__(self, mode, bias):
        self.mode, self.bias = mode, bias


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_objects_of_any_class_as_compiled_arguments(backend):
    """Enum members and config objects reach the function as they are (graph
    constants, guarded on identity); an unhashable one is a clear error."""
    torch._dynamo.reset()

    def body(x, settings, mode):
        y = x * settings.mode.value if mode is _Mode.SCALE else x + mode.value
        return y + settings.bias

    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(lambda x, settings, mode: torch.empty_like(x))
    run = leaf if backend is None else torch.compile(leaf, backend=backend, fullgraph=True)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for settings, mode in ((_Settings(_Mode.SCALE, 1.0), _Mode.SCALE), (_Settings(_Mode.SHIFT, -1.0), _Mode.SHIFT)):
        got = run(x, settings, mode)
        want = body(x, settings, mode)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x), torch.autograd.grad(want.sum(), x))

    class Unhashable(_Settings):
        __hash__ = None

    if backend is not None:
        with pytest.raises(Exception) as info:
            run(x, Unhashable(_Mode.SCALE, 0.0), _Mode.SCALE)
        chain = [info.value]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        # (Dynamo wraps errors raised at trace time in its own, keeping the message.)
        assert any("LeafFunctionError" in f"{type(e).__name__}{e}" and "not hashable" in str(e) for e in chain)


@pytest.mark.parametrize("backend", COMPILED)
def test_constant_outputs_of_compiled_calls_are_checked_on_every_call(backend):
    # A graph returns the constants the fake returned when it was traced; a
    # real call that returns another value (or an equal value of another
    # type, 1 for True) is an error, on every call, not only the first.
    def clip(x, limit):
        clipped = bool((x.abs() > limit).any())
        return x.clamp(-limit, limit), clipped, {"scale": 2}

    body = [clip]  # what the leaf runs: swapped below, as a changing configuration would
    leaf = _leaf(lambda x, limit: body[0](x, limit), lambda x, limit: (torch.empty_like(x), True, {"scale": 2}))
    run = torch.compile(lambda x, limit: leaf(x, limit), backend=backend, fullgraph=True)
    x = torch.tensor([0.5, -3.0, 2.0])
    for _ in range(3):
        out, clipped, extra = run(x, 1.0)
        torch.testing.assert_close(out, clip(x, 1.0)[0])
        assert clipped is True and extra == {"scale": 2}
    with pytest.raises(LeafFunctionError, match=r"returned False at output\[1\], but its fake implementation returned True"):
        run(x, 5.0)

    def clip_as_int(x, limit):
        out, clipped, extra = clip(x, limit)
        return out, int(clipped), extra

    body[0] = clip_as_int  # the same values, 1 for True
    with pytest.raises(LeafFunctionError, match=r"different output structure.*\n  real: \(Tensor, 1, "):
        run(x, 1.0)


@pytest.mark.parametrize("backend", COMPILED)
def test_a_nan_constant_output_matches_a_nan_fake(backend):
    """nan != nan: the constant check refused a nan that real and fake both
    return ("returned nan ..., but its fake implementation returned nan")."""
    def metric(x):
        return x * 2, float("nan"), complex(float("nan"), 1.0)

    body = [metric]
    leaf = _leaf(lambda x: body[0](x), lambda x: (torch.empty_like(x), float("nan"), complex(float("nan"), 1.0)))
    run = torch.compile(leaf, backend=backend, fullgraph=True)
    out, value, z = run(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))
    assert math.isnan(value) and math.isnan(z.real) and z.imag == 1.0
    # A nan in one part does not make the other part equal.
    body[0] = lambda x: (x * 2, float("nan"), complex(float("nan"), 2.0))
    with pytest.raises(LeafFunctionError, match=r"returned \(nan\+2j\) at output\[2\], but its fake implementation returned \(nan\+1j\)"):
        run(torch.ones(2))


@pytest.mark.parametrize("backend", COMPILED)
def test_tuple_outputs_without_constants_match_the_plain_function(backend):
    def pair(x):
        return x.sin(), (x * 3, [x.cos()])

    leaf = _leaf(pair, lambda x: (torch.empty_like(x), (torch.empty_like(x), [torch.empty_like(x)])))
    run = torch.compile(lambda x: leaf(x), backend=backend, fullgraph=True)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        out = run(x)
        expected = pair(x)
        torch.testing.assert_close(out, expected)
        loss = out[0].sum() + out[1][0].sum() + out[1][1][0].sum()
        g = torch.autograd.grad(loss, x)[0]
        e = torch.autograd.grad(expected[0].sum() + expected[1][0].sum() + expected[1][1][0].sum(), x)[0]
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("where", ["dispatch_mode", "aot_eager", "inductor"])
def test_conjugate_and_negative_views_in_the_body(where):
    """A TorchDispatchMode's handler (a user's mode, FlopCounterMode,
    AOTAutograd's runtime check of custom operators, active on every compiled
    call with grad) runs kernels with the conjugate and negative fallbacks
    excluded: the body's `z.conj() * 1j` read z unconjugated and returned
    [-2, -1] for [2, 1], silently."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def body(x):
        z = torch.complex(x, x.flip(0))
        return (z.conj() * 1j).real * (-z).imag.neg()

    torch._dynamo.reset()
    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(torch.empty_like)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    if where == "dispatch_mode":
        with Passthrough():
            got = leaf(x)
    else:
        got = torch.compile(leaf, backend=where, fullgraph=True)(x)
    expected = body(x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x), torch.autograd.grad(expected.sum(), x))


def test_eager_non_tensor_outputs_may_change_between_calls():
    """A tensors-only positional call (the eager fast path) checked its real
    output description against the first call's, as if a graph had traced
    it: the second call with another int, dtype or structure raised "a
    compiled graph can only return the traced constant", and the leaf stayed
    broken for every call that differed from the first."""

    def body(x):
        if x.sum() > 0:
            return x * 2, int(x.sum() > 0), x.dtype
        return (x * 2, 0, x.dtype, "negative")

    leaf = torchleaf.leaf_function(body)
    for x in (torch.ones(3), -torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(3)):
        got, expected = leaf(x), body(x)
        assert len(got) == len(expected)
        torch.testing.assert_close(got[0], expected[0])
        assert got[1:] == expected[1:]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_fake_returning_one_tensor_for_several_outputs(backend):
    """`(torch.empty_like(x),) * 3` told the graph that the three outputs
    share memory: the compiled program returned exp(x) for cos(x), silently
    (validate_outputs compares shapes, not identities). Fake outputs that
    alias each other or an input are copies now, as real ones are."""
    torch._dynamo.reset()

    def body(x):
        return x.sin(), x.cos(), x.exp()

    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(lambda x: (torch.empty_like(x),) * 3)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    got = torch.compile(lambda x: leaf(x)[1] * 2 + leaf(x)[2], backend=backend, fullgraph=True)(x)
    expected = body(x)[1] * 2 + body(x)[2]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x), torch.autograd.grad(expected.sum(), x))


def test_non_tensor_outputs_through_the_operator_without_a_fake():
    """Under a dispatch mode a call goes through the operator, whose outputs
    are tensors only: its caller gets the first such call's constants, so a
    changed one is an error -- which said a fake had returned the value "when
    the graph was traced", though no fake ran and nothing was compiled."""
    from torch.utils.flop_counter import FlopCounterMode

    count = [0]

    @torchleaf.leaf_function
    def counted(x):
        count[0] += 1
        return x * 2, count[0]

    x = torch.ones(2)
    with FlopCounterMode(display=False):
        assert counted(x)[1] == 1
        with pytest.raises(LeafFunctionError, match=r"returned 2 at output\[1\], but 1 there on its first call"):
            counted(x)
    assert counted(x)[1] == 3  # eagerly, every call's own


@pytest.mark.parametrize("backend", [*COMPILED, "make_fx"])
def test_an_int_that_a_later_trace_makes_negative(backend):
    """A fake's int expression that the first trace knows is non-negative
    only because dynamic sizes are >= 2 (x.shape[0] - 2) is carried so that
    a later trace, which specializes a size to 1 or 0, returns it negative:
    the fake is right, so every call returns the plain function's int."""
    torch._dynamo.reset()
    from torch.fx.experimental.proxy_tensor import make_fx

    def body(x):
        return x * 2, x.shape[0] - 2

    leaf = _leaf(body, lambda x: (torch.empty_like(x), x.shape[0] - 2))

    def use(f):
        def step(x):
            y, n = f(x)
            return y.sum() + n, n

        return step

    if backend == "make_fx":
        compiled = make_fx(use(leaf), tracing_mode="symbolic")(torch.randn(5))
    else:
        compiled = torch.compile(use(leaf), backend=backend, fullgraph=True, dynamic=True)
    for size in (5, 3, 1, 0, 2):
        x = torch.randn(size)
        got, expected = compiled(x), use(body)(x)
        assert got[1] == expected[1] == size - 2
        torch.testing.assert_close(got[0], expected[0])


@pytest.mark.parametrize("mode", ["eager", *COMPILED])
def test_a_container_argument_changed_in_place_is_an_error(mode):
    """A leaf gets its own copy of each list or dict argument (the tensors
    inside become the call's own): an append or an assignment there would
    never reach the caller's container, where the plain function changes
    it, so it is an error naming the argument. Containers the function only
    reads pass, and an object of the user's own class is the function's
    itself: changes to it persist, eager and compiled."""
    torch._dynamo.reset()

    class Log:
        def __init__(self):
            self.items = []

    def scale(x, factors, log):
        log.items.append(len(factors["by"]))
        return x * factors["by"][0]

    def append(x, history):
        history.append(float(x.sum()))
        return x * 2

    def assign(x, opts):
        opts["seen"] = True
        return x * opts["scale"]

    leaves = {}
    for fn in (scale, append, assign):
        leaf = _leaf(fn, lambda x, *rest, **options: torch.empty_like(x))
        leaves[fn.__name__] = leaf if mode == "eager" else torch.compile(leaf, backend=mode, fullgraph=True)
    x = torch.randn(3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    log = Log()
    for _ in range(2):
        out = leaves["scale"](x, {"by": [w, 3.0]}, log)
    torch.testing.assert_close(out, x * w)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), w)[0], x.sum())
    assert log.items == [2, 2]
    history = []
    with pytest.raises(LeafFunctionError, match=r"changed its argument 'history' \(a list\) in place\. "
                       r"A leaf function gets its own copy"):
        leaves["append"](x, history)
    with pytest.raises(LeafFunctionError, match=r"changed its argument 'opts' \(a dict\) in place"):
        leaves["assign"](x, opts={"scale": 2.0})
    assert torchleaf.live_states() == 0


def test_an_iterator_argument_of_a_compiled_call_is_a_clear_error():
    """The compiler consumes a generator while it traces: a compiled call
    cannot pass one on, and says so naming the leaf (eager calls take it)."""
    torch._dynamo.reset()

    def product(x, factors):
        for f in factors:
            x = x * f
        return x

    leaf = _leaf(product, lambda x, factors: torch.empty_like(x))
    x = torch.randn(3)
    torch.testing.assert_close(leaf(x, (f for f in (2.0, 3.0))), x * 6)
    compiled = torch.compile(lambda x: leaf(x, (f for f in (2.0, 3.0))), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as raised:
        compiled(x)
    cause = raised.value
    while not isinstance(cause, LeafFunctionError) and (cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, LeafFunctionError)
    assert "product' got a generator argument in a compiled call" in str(cause)
    assert "Pass a list or a tuple" in str(cause)


def test_a_fake_whose_structure_follows_a_module_setting_is_a_clear_error(monkeypatch):
    """A fake runs on any module of its argument's structure, so one whose
    output structure follows a module setting (an auxiliary loss only in
    training) can see another setting than the real call: with an eval-mode
    copy alive, the two fakes of one trace could run on different modules,
    and compiled code kept the fake's None where the function returned a
    tensor (a probe found it, silent), or failed naming no leaf. Two output
    structures for one call structure are now a clear error that says what
    to pass instead; with the setting as an argument both modes work."""
    torch._dynamo.reset()

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 4)

    def route(router, x):
        y = router.gate(x)
        return y, (y.pow(2).mean() if router.training else None)

    def fake(router, x):
        y = torch.empty_like(x)
        return y, (x.new_empty(()) if router.training else None)

    router, x = Router(), torch.randn(2, 4)
    ema = Router().eval()  # e.g. an EMA copy for evaluation
    # Which module of the structure a fake runs on is up to the order of a
    # weak set: here Dynamo's run of the fake gets the eval-mode copy and
    # AOTAutograd's the training one, as a probe saw.
    from torchleaf import _module_index

    picks = iter([ema])
    monkeypatch.setattr(_module_index, "of_structure", lambda leaf, structure, tensors: next(picks, router))
    leaf = _leaf(route, fake)
    compiled = torch.compile(lambda r, x: leaf(r, x), backend="aot_eager", fullgraph=True)
    # (Raised while AOTAutograd traces, inside Dynamo's BackendCompilerFailed.)
    with pytest.raises(Exception, match=r"returned two output structures for one call structure:"
                       r"\n  \(Tensor, None\)\n  \(Tensor, Tensor\)\n"):
        compiled(router, x)
    monkeypatch.undo()

    def route_by(router, x, training):
        y = router.gate(x)
        return y, (y.pow(2).mean() if training else None)

    leaf = _leaf(route_by, lambda router, x, training: (torch.empty_like(x), x.new_empty(()) if training else None))
    compiled = torch.compile(lambda r, x: leaf(r, x, r.training), backend="aot_eager", fullgraph=True)
    for training in (True, False, True):
        router.train(training)
        out, aux = compiled(router, x)
        expected = route_by(router, x, training)
        torch.testing.assert_close(out, expected[0])
        assert (aux is None) == (not training)


def _capacity_rows(x, capacity):
    return x[: int(x.shape[0] * capacity)] * 2


def _capacity_fake(x, capacity):
    return x.new_empty(int(x.shape[0] * capacity), x.shape[1])


def test_a_float_the_fake_sizes_an_output_with_is_static_or_a_clear_error():
    """A capacity factor that sizes an output: without static_argnames the
    fake gets a stand-in, and reading its value says how to mark it static
    (before, the fake sized the output with the stand-in 1.0 and the user
    was told the fake was wrong); with it, its value is baked in and a new
    value compiles again, as plain code does."""
    torch._dynamo.reset()
    x = torch.randn(8, 3)
    dynamic = _leaf(_capacity_rows, _capacity_fake)
    compiled = torch.compile(lambda x, c: dynamic(x, c), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"read the value of float argument 'capacity'.*static_argnames=\('capacity',\)"):
        compiled(x, 0.5)
    torch.testing.assert_close(dynamic(x, 0.5), _capacity_rows(x, 0.5))  # eager: the real value

    static = torchleaf.leaf_function(_capacity_rows, static_argnames="capacity")
    static.register_fake(_capacity_fake)
    frames = {}
    for name, fn in (("leaf", static), ("plain", _capacity_rows)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(lambda x, c, fn=fn: fn(x, c), backend=counter, fullgraph=True)
        for c in (0.5, 0.5, 0.25, 0.75, 0.25):
            torch.testing.assert_close(compiled(x, c), _capacity_rows(x, c))
        frames[name] = counter.frame_count
    assert frames["leaf"] <= frames["plain"] + 1, frames
    with pytest.raises(LeafFunctionError, match=r"static_argnames=\['cap'\], which is not a parameter"):
        torchleaf.leaf_function(_capacity_rows, static_argnames=("cap",))
