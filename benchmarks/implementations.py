"""The bodies and the implementations compared by the benchmarks.

A *body* is the computation (plain PyTorch code, its fake and a hand-written
backward). An *implementation* wraps a body the way a user would: inline,
as a torch.autograd.Function, as a torch.library.custom_op, with PyTorch's
built-in leaf_function, behind a graph break, or as a torchleaf leaf.

Every implementation is built from a fresh copy of the body's function, so
each compiled variant has its own code object: Dynamo caches per code object,
and variants sharing one would pay for each other's guards.
"""

import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

import torchleaf

LIBRARY = "torchleaf_bench"


def fresh_function(fn, name=None):
    """A copy of ``fn`` with its own code object (same globals and closure)."""
    name = name or fn.__name__
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__module__ = fn.__module__
    return copy


# ---------------------------------------------------------------------- bodies
@dataclass(frozen=True)
class Body:
    name: str
    description: str
    fn: Callable  # the plain computation, annotated for custom_op
    fake: Callable  # output metadata only
    setup_context: Callable  # (ctx, inputs, output): what backward needs
    backward: Callable  # (ctx, grad) -> input grads, written by hand
    make_inputs: Callable  # () -> tuple of tensors requiring grad


def small_body(x: Tensor) -> Tensor:
    return x * 2 + 1


def _small_fake(x):
    return torch.empty_like(x)


def _small_setup(ctx, inputs, output):
    pass


def _small_backward(ctx, grad):
    return grad * 2


def medium_body(x: Tensor, w: Tensor) -> Tensor:
    return x @ w


def _medium_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _medium_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _medium_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.mT, x.mT @ grad


SMALL = Body(
    name="small",
    description="`x * 2 + 1`, x: 64 float32",
    fn=small_body,
    fake=_small_fake,
    setup_context=_small_setup,
    backward=_small_backward,
    make_inputs=lambda: (torch.randn(64, requires_grad=True),),
)

MEDIUM = Body(
    name="medium",
    description="`x @ w`, x, w: 256x256 float32",
    fn=medium_body,
    fake=_medium_fake,
    setup_context=_medium_setup,
    backward=_medium_backward,
    make_inputs=lambda: (
        torch.randn(256, 256, requires_grad=True),
        torch.randn(256, 256, requires_grad=True),
    ),
)

BODIES = (SMALL, MEDIUM)


# ------------------------------------------------------------- implementations
@dataclass(frozen=True)
class Implementation:
    key: str
    label: str
    build: Callable  # Body -> callable taking the body's inputs
    compiled_only: bool = False  # meaningless in eager mode


def build_plain(body):
    return fresh_function(body.fn, f"{body.name}_plain")


def build_autograd_function(body):
    fn = fresh_function(body.fn, f"{body.name}_function_body")
    setup, backward = body.setup_context, body.backward  # Dynamo cannot wrap Body

    class HandWritten(torch.autograd.Function):
        @staticmethod
        def forward(*inputs):
            return fn(*inputs)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup(ctx, inputs, output)

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

    HandWritten.__name__ = HandWritten.__qualname__ = f"{body.name.title()}Function"
    return HandWritten.apply


def build_custom_op(body):
    op = torch.library.custom_op(
        f"{LIBRARY}::{body.name}", fresh_function(body.fn, f"{body.name}_custom_op"), mutates_args=()
    )
    op.register_fake(body.fake)
    op.register_autograd(body.backward, setup_context=body.setup_context)
    return op


def build_builtin_leaf(body):
    from torch._dynamo.decorators import leaf_function

    leaf = leaf_function(fresh_function(body.fn, f"{body.name}_builtin_leaf"))
    leaf.register_fake(body.fake)
    return leaf


def build_graph_break(body):
    return torch.compiler.disable(fresh_function(body.fn, f"{body.name}_graph_break"))


def build_torchleaf(body):
    leaf = torchleaf.leaf_function(fresh_function(body.fn, f"{body.name}_torchleaf"))
    leaf.register_fake(body.fake)
    return leaf


IMPLEMENTATIONS = (
    Implementation("plain", "plain (inline)", build_plain),
    Implementation("autograd_function", "autograd.Function", build_autograd_function),
    Implementation("custom_op", "custom_op", build_custom_op),
    Implementation("builtin_leaf", "built-in leaf_function", build_builtin_leaf),
    Implementation("graph_break", "graph break", build_graph_break, compiled_only=True),
    Implementation("torchleaf", "torchleaf", build_torchleaf),
)


def make_loss(call, name):
    """``call(*inputs).sum()`` as a function with its own code object."""

    def loss(*inputs):
        return call(*inputs).sum()

    return fresh_function(loss, name)
