"""The Python <-> C++ seam: one core entry per leaf, call plans keyed by
structure, results returned with the call that made them, nothing immortal
that holds user objects. Each test here failed on the design it replaced."""

import copy
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx

import torchleaf
from torchleaf import LeafFunctionError

BACKENDS = ["eager", "aot_eager", "inductor"]


def test_a_real_call_through_the_operator_leaves_nothing_for_another_leaf():
    @torchleaf.leaf_function
    def triple(x):
        return (x * 3,)

    @triple.register_fake
    def _(x):
        return (torch.empty_like(x),)

    gm = make_fx(lambda x: triple(x), tracing_mode="symbolic")(torch.randn(3))
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), (x * 3,))  # a real call through torchleaf::call

    @torchleaf.leaf_function
    def positives(x):
        return (x.relu(), (x > 0).nonzero())

    @positives.register_fake
    def _(x):
        return (torch.empty_like(x), (x > 0).nonzero())

    gm2 = make_fx(lambda x: positives(x), tracing_mode="symbolic")(torch.randn(5, 4))
    x = torch.randn(5, 4)
    out = gm2(x)
    assert len(out) == 2
    torch.testing.assert_close(out[0], x.relu())
    torch.testing.assert_close(out[1], (x > 0).nonzero())


def test_validation_error_names_the_leaf_after_an_unrelated_real_call():
    @torchleaf.leaf_function
    def unrelated(x):
        return x + 1

    @unrelated.register_fake
    def _(x):
        return torch.empty_like(x)

    gm = make_fx(lambda x: unrelated(x), tracing_mode="fake")(torch.ones(2))
    gm(torch.ones(2))  # runs a real call through the operator first

    @torchleaf.leaf_function(validate_outputs=True)
    def drifting(x):
        return x * 2, x * 3

    @drifting.register_fake
    def _(x):
        return (torch.empty_like(x),)

    with pytest.raises(LeafFunctionError, match=r"'[\w.<>]*drifting' returned a different output structure"):
        drifting(torch.ones(2))
    assert torchleaf.live_states() == 0


def _nested_leaves():
    @torchleaf.leaf_function
    def inner(x):
        return x.sin() * 2

    @inner.register_fake
    def _(x):
        return torch.empty_like(x)

    @torchleaf.leaf_function
    def outer(x, w):
        return inner(x * w) + w

    @outer.register_fake
    def _(x, w):
        return torch.empty_like(x)

    return outer


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_leaf_calling_another_leaf(backend):
    outer = _nested_leaves()

    def program(x, w):
        return outer(x, w)

    def reference(x, w):
        return (x * w).sin() * 2 + w

    run = program if backend is None else torch.compile(program, backend=backend, fullgraph=True)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = run(x, w)
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    ex, ew = torch.autograd.grad(reference(x, w).sum(), (x, w))
    torch.testing.assert_close(out, reference(x, w))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
    assert torchleaf.live_states() == 0


def test_an_exception_in_one_leaf_then_a_traced_call_of_another():
    class Boom(Exception):
        pass

    @torchleaf.leaf_function
    def fails(x):
        raise Boom("no")

    @torchleaf.leaf_function
    def works(x, scale):
        return x * scale, "done"

    @works.register_fake
    def _(x, scale):
        return torch.empty_like(x), "done"

    with pytest.raises(Boom):
        fails(torch.ones(2, requires_grad=True))
    gm = make_fx(lambda x: works(x, 3.0), tracing_mode="fake")(torch.ones(2))
    out, tag = gm(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 3.0))
    assert tag == "done"
    assert torchleaf.live_states() == 0


def test_two_threads_alternate_tracing_and_running_different_leaves():
    def make(k):
        @torchleaf.leaf_function
        def leaf(x):
            return tuple(x * i for i in range(1, k + 1))

        @leaf.register_fake
        def _(x):
            return tuple(torch.empty_like(x) for _ in range(k))

        return leaf

    leaves = [make(2), make(3)]
    errors = []
    # make_fx itself is not thread-safe (torch.fx patches globals while it
    # traces): one thread traces while the other runs eager and graph calls.
    tracing = threading.Lock()

    def worker(k):
        try:
            leaf = leaves[k]
            for step in range(30):
                x = torch.randn(3)
                if step % 2:
                    with tracing:
                        gm = make_fx(lambda x: leaf(x), tracing_mode="fake")(x)
                    out = gm(x)
                else:
                    out = leaf(x)
                assert len(out) == k + 2
                torch.testing.assert_close(out[-1], x * (k + 2))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    assert errors == []


def test_numpy_and_unhashable_arguments():
    class Options:  # unhashable: defines __eq__ without __hash__
        def __init__(self, k):
            self.k = k

        def __eq__(self, other):
            return self.k == other.k

    @torchleaf.leaf_function
    def scale(x, arr, opts, names):
        return x * float(arr.sum()) + opts.k + len(names)

    @scale.register_fake
    def _(x, arr, opts, names):
        return torch.empty_like(x)

    x = torch.ones(2, requires_grad=True)
    out = scale(x, np.ones(3), Options(2), ["a", "b"])
    torch.testing.assert_close(out, torch.full((2,), 7.0))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 3.0))
    # Traced, a numpy array travels as a tensor; an unhashable constant cannot
    # be baked into a graph, and says so.
    class Config:  # hashable (by identity)
        k = 1.5

    gm = make_fx(lambda x: scale(x, np.full(3, 2.0), Config(), ["a"]), tracing_mode="fake")(torch.ones(2))
    torch.testing.assert_close(gm(torch.ones(2)), torch.full((2,), 8.5))
    with pytest.raises(LeafFunctionError, match=r"'[\w.<>]*scale' got an argument of type Options, which is not hashable"):
        make_fx(lambda x: scale(x, np.ones(3), Options(1), ["a"]), tracing_mode="fake")(torch.ones(2))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_numpy_array_argument_compiled(backend):
    @torchleaf.leaf_function
    def weighted(x, arr):
        return x * float(np.asarray(arr).sum())

    @weighted.register_fake
    def _(x, arr):
        return torch.empty_like(x)

    arr = np.arange(4.0)
    f = torch.compile(lambda x: weighted(x, arr), backend=backend, fullgraph=True)
    torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 6.0))
    arr[0] = 10.0  # the array is read at run time
    torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 16.0))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_non_tensor_outputs_compiled(backend):
    @torchleaf.leaf_function
    def counted(x, n):
        return x * 2, n + 1

    @counted.register_fake
    def _(x, n):
        return torch.empty_like(x), n + 1

    f = torch.compile(lambda x: counted(x, 2), backend=backend, fullgraph=True)
    out, n = f(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))
    assert n == 3

    @torchleaf.leaf_function
    def placeholder(x):
        return x * 2, 3

    @placeholder.register_fake
    def _(x):
        return torch.empty_like(x), 0  # wrong: the graph would return 0

    g = torch.compile(lambda x: placeholder(x), backend=backend, fullgraph=True)
    with pytest.raises(LeafFunctionError, match=r"'[\w.<>]*placeholder' returned 3 at output\[1\], but its fake "
                       r"implementation returned 0 there"):
        g(torch.ones(2))


def _gate():
    @torchleaf.leaf_function
    def gate(h, head):
        scores = head(h)
        if scores.abs().max() > 1e6:  # data-dependent control flow
            print("large scores")
        return scores.tanh()

    @gate.register_fake
    def _(h, head):
        return h.new_empty(h.shape[0], head.out_features)

    return gate


class _Layer(nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.head = nn.Linear(8, 8)
        self.gate = gate

    def forward(self, x):
        return self.gate(x, self.head) * 2 + x


@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_layers_compile_to_one_frame(backend):
    torch._dynamo.reset()
    gate = _gate()
    model = nn.Sequential(*[_Layer(gate) for _ in range(10)]).double()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    model(x).sum().backward()
    for got, expected in zip(grads, [p.grad for p in model.parameters()] + [x.grad]):
        torch.testing.assert_close(got, expected)
    assert counter.frame_count == 1

    # One compiled function for every layer: modules are inputs, not constants.
    per_layer = CompileCounterWithBackend(backend)
    run = torch.compile(lambda layer, x: layer(x), backend=per_layer, fullgraph=True)
    with torch.no_grad():
        for layer in model:
            torch.testing.assert_close(run(layer, x), layer(x))
    assert per_layer.frame_count == 1


def test_a_copied_model_runs_with_its_own_module():
    torch._dynamo.reset()
    gate = _gate()
    model = _Layer(gate)
    x = torch.randn(2, 8)
    model(x)  # seen eagerly
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.head.weight.mul_(-1)
    run = torch.compile(lambda m, x: m(x), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(run(model, x), model(x))
        torch.testing.assert_close(run(clone, x), clone(x))
        assert not torch.allclose(clone(x), model(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_an_unpickled_module_runs_compiled_as_itself(backend):
    """A handle does not travel in a pickle: the unpickled module's stands
    for no module, and its compiled calls (no eager call before them) find
    it by its tensors."""
    import pickle

    torch._dynamo.reset()
    gate = _gate()
    head = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    gate(x, head)  # seen eagerly: carries a handle
    clones = [pickle.loads(pickle.dumps(head)) for _ in range(2)]
    for i, clone in enumerate(clones):
        with torch.no_grad():
            clone.weight.mul_(-1 - i)
    counter = CompileCounterWithBackend(backend)
    run = torch.compile(lambda x, m: gate(x, m), backend=counter, fullgraph=True)
    with torch.no_grad():
        for m in (*clones, head, *clones):
            torch.testing.assert_close(run(x, m), m(x).tanh())
    assert not torch.allclose(clones[0](x), head(x))
    # One graph for both clones (nothing guards a module's identity), and
    # one for the module with a handle of its own (Dynamo guards the type
    # of what the module's __dict__ holds there); later calls reuse them.
    assert counter.frame_count == 2


@pytest.mark.slow
def test_inductor_may_reuse_an_output_buffer_the_captured_graph_saved():
    """tanh saves its result for backward; Inductor computed `out * 2` in the
    output's own buffer, corrupting that saved result."""
    torch._dynamo.reset()

    @torchleaf.leaf_function
    def squash(x, w):
        return (x @ w).tanh()

    @squash.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    f = torch.compile(lambda x, w: squash(x, w) * 2, backend="inductor", fullgraph=True)
    got = torch.autograd.grad(f(x, w).sum(), (x, w))
    expected = torch.autograd.grad(((x @ w).tanh() * 2).sum(), (x, w))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("held_by", ["global", "module_attribute", "log"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.slow
def test_inductor_never_writes_into_an_output_something_else_holds(held_by, grad):
    """A body that returns a tensor it does not own (a global table, a plain
    module attribute, a result it also logs):
    Inductor computed the next kernel in place in that buffer, so the table
    changed under its owner and later calls returned wrong values."""
    torch._dynamo.reset()
    table = torch.arange(4.0)
    log = {}

    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = table  # a plain attribute, not a buffer

    def body(x, m):
        if held_by == "global":
            return table, table * 0
        if held_by == "module_attribute":
            return m.table, table * 0
        out = x.softmax(0)
        log["last"] = out
        return out, table * 0

    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(lambda x, m: (x.new_empty(4), x.new_empty(4)))
    module = Lookup()

    def program(fn, x):
        # (Each result the size of a leaf output, which Inductor may then
        # compute in that output's buffer.)
        a, b = fn(x, module)
        return (a * 2 + x).relu(), (b * 3 + x).relu()

    compiled = torch.compile(lambda x: program(leaf, x), backend="inductor", fullgraph=True)
    for _ in range(3):
        x = torch.randn(4, requires_grad=grad)
        got, expected = compiled(x), program(body, x)
        torch.testing.assert_close(got, expected)
        if grad:
            torch.testing.assert_close(
                torch.autograd.grad(sum(t.sum() for t in got), x), torch.autograd.grad(sum(t.sum() for t in expected), x)
            )
        torch.testing.assert_close(table, torch.arange(4.0))
        if held_by == "log":
            torch.testing.assert_close(log["last"], x.detach().softmax(0))
    # Eager calls return what the function returned, as the plain one does.
    assert (leaf(x, module)[0] is table) == (held_by != "log")
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("pattern", ["two_calls", "vmap", "mm_then_tanh"])
@pytest.mark.slow
def test_inductor_keeps_an_input_buffer_the_captured_graph_saved(pattern):
    """sin saves its input for backward, mm both operands. Inductor reused the
    buffer of an intermediate passed to a leaf for its next kernel, so the
    replay read another call's values: right outputs, wrong gradients."""
    torch._dynamo.reset()
    sin = torchleaf.leaf_function(torch.sin)
    sin.register_fake(torch.empty_like)
    mm = torchleaf.leaf_function(torch.mm)
    mm.register_fake(lambda a, b: a.new_empty(a.shape[0], b.shape[1]))
    programs = {
        "two_calls": lambda f, g, x, w: (f(x[0] * 2) + f(x[1] * 2)).sum(),
        "vmap": lambda f, g, x, w: torch.vmap(f)(x * 2).sum(),
        "mm_then_tanh": lambda f, g, x, w: g(x * 2, w).tanh().sum(),
    }
    program = programs[pattern]
    x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda x, w: program(sin, mm, x, w), backend="inductor", fullgraph=True)
    got = torch.autograd.grad(compiled(x, w), (x, w), allow_unused=True, materialize_grads=True)
    expected = torch.autograd.grad(
        program(torch.sin, torch.mm, x, w), (x, w), allow_unused=True, materialize_grads=True
    )
    torch.testing.assert_close(got, expected)
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("passed", ["whole", "view"])
@pytest.mark.slow
def test_inductor_copies_an_input_the_graph_changes_in_place_afterwards(passed):
    """The body saves its input `w` (mul does); the compiled function then
    changes `w` in place. Inductor writes that change into w's buffer, and
    bumped w's version before the graph ran, so the replay read the new
    values: wrong gradients, silently (eager and aot_eager raise "modified by
    an inplace operation"). The call now gets a copy of such an input."""
    torch._dynamo.reset()

    @torchleaf.leaf_function
    def weigh(h, w):
        return (h.sin() * w).sum(0)

    @weigh.register_fake
    def _(h, w):
        return h.new_empty(h.shape[1:])

    pick = (lambda w: w) if passed == "whole" else (lambda w: w[1])

    def program(x, w):
        y = weigh(x * 2, pick(w))
        w.add_(1)
        return y.sum()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64) if passed == "whole" else torch.randn(2, 3, 4, dtype=torch.float64)
    before = w.clone()
    (got,) = torch.autograd.grad(torch.compile(program, backend="inductor", fullgraph=True)(x, w), x)
    torch.testing.assert_close(w, before + 1)
    (expected,) = torch.autograd.grad(((x * 2).sin() * pick(before)).sum(), x)
    torch.testing.assert_close(got, expected)
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_models_leaves_and_module_arguments_are_collected(compiled):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 3)

            @torchleaf.leaf_function
            def inner(x, m):
                return m(x) * 2

            @inner.register_fake
            def _(x, m):
                return torch.empty_like(x)

            self.inner = inner

        def forward(self, x):
            return self.inner(x, self.head)

    gc.collect()
    leaves_before = torchleaf._C.leaf_count()
    model = Model()
    refs = [weakref.ref(model), weakref.ref(model.head), weakref.ref(model.inner)]
    x = torch.randn(2, 3, requires_grad=True)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    run(x).sum().backward()
    assert torchleaf._C.leaf_count() == leaves_before + 1
    del model, run
    torch._dynamo.reset()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert torchleaf._C.leaf_count() == leaves_before
    assert torchleaf.live_states() == 0


def test_a_graph_that_outlives_its_leaf_fails_clearly():
    @torchleaf.leaf_function
    def temporary(x):
        return x + 1

    @temporary.register_fake
    def _(x):
        return torch.empty_like(x)

    gm = make_fx(lambda x: temporary(x), tracing_mode="fake")(torch.ones(2))  # noqa: F821 (deleted at the end)
    torch.testing.assert_close(gm(torch.ones(2)), torch.full((2,), 2.0))
    del temporary, _
    gc.collect()
    with pytest.raises(RuntimeError, match="no leaf function has id .* its Python function was deleted"):
        gm(torch.ones(2))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_backward_in_flight_outlives_its_leaf(backend):
    """As with a plain function, the forward's graph is all a backward needs:
    the leaf, its compiled function and the leaf's Python objects may be gone
    (each state keeps its leaf's core entry, not the Python function)."""

    def make():
        @torchleaf.leaf_function
        def temporary(x):
            return x.sin() * 2

        @temporary.register_fake
        def _(x):
            return torch.empty_like(x)

        return temporary

    leaf = make()
    ref = weakref.ref(leaf)
    compiled = torch.compile(lambda x: leaf(x).sum(), backend=backend, fullgraph=True)  # noqa: F821 (deleted before the call)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    loss = compiled(x)
    del leaf, compiled
    gc.collect()
    assert ref() is None
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    del loss
    assert torchleaf.live_states() == 0


@pytest.mark.parametrize("mode", ["eager", "make_fx", "aot_eager"])
def test_positional_constants_reach_the_function(mode):
    @torchleaf.leaf_function
    def scaled(x, k, y):
        return x * k + y

    @scaled.register_fake
    def _(x, k, y):
        return torch.empty_like(x)

    x, y = torch.ones(2), torch.full((2,), 0.5)
    if mode == "eager":
        run = scaled
    elif mode == "make_fx":
        run = make_fx(lambda x, k, y: scaled(x, k, y), tracing_mode="fake")(x, 3.0, y)
    else:
        run = torch.compile(scaled, backend=mode, fullgraph=True)
    torch.testing.assert_close(run(x, 3.0, y), torch.full((2,), 3.5))
