"""The direct entries compiled graphs call torchleaf::call/forward/backward
through (csrc/python/operator_entries.cpp): the same results and errors as
PyTorch's own boxed entry, which they hand every call they do not take
(keywords, torch function modes, tensor subclasses, SymInts)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import torchleaf
from _graphs import compiled_call_site, order_token
from torchleaf import _C
from torchleaf._torch_private import OP_OVERLOAD_HASHES_BY_OP

_NAMES = ("call", "forward", "backward")


def _scaled(x):
    return x * 3 + 1


@pytest.fixture
def leaf_call():
    """A leaf, the id and plan of a compiled positional call of it, and one
    input that requires grad."""
    leaf = torchleaf.leaf_function(_scaled)
    leaf.register_fake(torch.empty_like)
    x = torch.randn(5, dtype=torch.float64)
    leaf_id, plan = compiled_call_site(leaf, x)
    return leaf, leaf_id, plan, x


class _Spy:
    """Stands in for PyTorch's entry: records what was handed to it."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.real(*args, **kwargs)


def _entries():
    spies = {name: _Spy(getattr(torch.ops.torchleaf, name).default._op.__self__) for name in _NAMES}
    return {name: _C.direct_operator_entry(name, spy) for name, spy in spies.items()}, spies


def test_the_operators_call_through_the_direct_entries():
    for name in _NAMES:
        overload = getattr(torch.ops.torchleaf, name).default
        assert overload._op.__name__ == name
        # The entry replaced is PyTorch's, and the overload hashes by the new
        # one (has_side_effect's registry found it: see test_compile's
        # dead-code tests).
        assert type(overload._op.__self__).__name__ == "builtin_function_or_method"
        # (Through 2.13 an overload hashes by its `_op`: the entry had to be
        # replaced before anything hashed it.)
        if OP_OVERLOAD_HASHES_BY_OP:
            assert hash(overload) == hash(overload._op)


def test_direct_and_pytorch_entries_agree_on_values_and_gradients(leaf_call):
    _, leaf_id, plan, x = leaf_call
    entries, spies = _entries()
    token = order_token()
    direct_out, direct_state = entries["forward"](leaf_id, plan, [x, token], [0])
    torch_out, torch_state = spies["forward"].real(leaf_id, plan, [x, token], [0])
    torch.testing.assert_close(direct_out[0], _scaled(x))
    torch.testing.assert_close(direct_out[0], torch_out[0])
    assert direct_out[1].shape == (0,) and direct_out[1].dtype == torch.int64  # the new token

    grad = torch.randn(5, dtype=torch.float64)
    meta = [_C.scalar_type_code(x), 0, -1, 1, 5]
    (direct_grad,) = entries["backward"](leaf_id, direct_state, [grad, None], meta)
    (torch_grad,) = spies["backward"].real(leaf_id, torch_state, [grad, None], meta)
    torch.testing.assert_close(direct_grad, grad * 3)
    torch.testing.assert_close(direct_grad, torch_grad)

    (called, _token) = entries["call"](leaf_id, plan, [x, token])
    torch.testing.assert_close(called, _scaled(x))
    assert all(not spy.calls for spy in spies.values())
    del direct_state, torch_state  # each handle holds its captured state
    assert _C.live_states() == 0


def test_other_calls_go_to_pytorchs_entry_unchanged(leaf_call):
    _, leaf_id, plan, x = leaf_call
    entries, spies = _entries()
    token = order_token()

    class Logged(torch.Tensor):
        seen = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    class Mode(TorchFunctionMode):
        seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    forward = torch.ops.torchleaf.forward.default
    handed_over = [
        ((leaf_id, plan, [x, token]), {"differentiable": [0]}),  # a keyword
        ((leaf_id, plan, (x, token), [0]), {}),  # a tuple, not a list
        ((leaf_id, plan, [x, token], [True]), {}),  # a bool, not an int
        ((leaf_id, plan, [x.as_subclass(Logged), token], [0]), {}),  # an overriding subclass
    ]
    for args, kwargs in handed_over:
        outputs, _ = entries["forward"](*args, **kwargs)
        torch.testing.assert_close(outputs[0].as_subclass(torch.Tensor), _scaled(x))
        assert spies["forward"].calls[-1] == (args, kwargs)
    assert forward in Logged.seen  # the subclass saw the operator call

    with Mode():
        entries["call"](leaf_id, plan, [x, token])
    assert spies["call"].calls and torch.ops.torchleaf.call.default in Mode.seen


def test_direct_entries_raise_pytorchs_errors(leaf_call):
    _, _, plan, x = leaf_call
    entries, spies = _entries()
    dead = 1 << 62  # no leaf has this id
    raised = []
    for call in (entries["call"], spies["call"].real):
        with pytest.raises(RuntimeError) as info:
            call(dead, plan, [x])
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1] and f"has id {dead}" in raised[0][1]
    with pytest.raises(RuntimeError, match="missing value for argument"):  # as PyTorch reports it
        entries["forward"](dead, plan, [x])
    # The process stays usable.
    _, leaf_id, plan, _ = leaf_call
    torch.testing.assert_close(entries["call"](leaf_id, plan, [x, order_token()])[0], _scaled(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_steps_through_the_direct_entries(backend):
    calls = []

    def body(x, w):
        calls.append(1)
        return torch.tanh(x @ w)

    leaf = torchleaf.leaf_function(body)
    leaf.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[1]))
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    step = torch.compile(lambda x, w: leaf(x, w).square().sum(), backend=backend, fullgraph=True)
    for _ in range(3):
        calls.clear()
        gx, gw = torch.autograd.grad(step(x, w), (x, w))
        ex, ew = torch.autograd.grad(body(x, w).square().sum(), (x, w))
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gw, ew)
        assert len(calls) == 2  # the compiled call, then the eager reference
    assert _C.live_states() == 0
