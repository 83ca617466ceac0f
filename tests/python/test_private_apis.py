"""The private PyTorch APIs torchleaf depends on (docs/design.md, "Private
PyTorch APIs"), each checked for the behaviour torchleaf relies on, so that a
PyTorch upgrade that changes one fails here, by name, rather than somewhere
deep in a compiled program."""

import inspect

import pytest
import torch

import torchleaf


def test_assume_constant_result_is_evaluated_at_trace_time_and_baked_in():
    calls = []

    @torch._dynamo.assume_constant_result
    def constant(tag):
        calls.append(tag)
        return 3

    f = torch.compile(lambda x: x * constant("k"), backend="eager", fullgraph=True)
    torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 3.0))
    torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 3.0))
    assert calls == ["k"]  # once, at trace time


def test_effectful_op_registration_marks_an_operator_ordered():
    # torchleaf registers C++ leaves' named operators this way.
    from torch._higher_order_ops.effects import _EffectType, _get_effect, _register_effectful_op

    lib = torch.library.Library("torchleaf_private_api_test", "FRAGMENT")
    lib.define("noop(Tensor x) -> Tensor")
    op = torch.ops.torchleaf_private_api_test.noop.default
    assert _get_effect(op) is None
    handle = _register_effectful_op(op, _EffectType.ORDERED)
    assert _get_effect(op) == _EffectType.ORDERED
    handle.destroy()
    lib._destroy()


def test_torchleaf_operators_are_impure_not_effectful():
    from torch._higher_order_ops.effects import _get_effect
    from torch._library.utils import is_impure

    for op in (torch.ops.torchleaf.call, torch.ops.torchleaf.forward, torch.ops.torchleaf.call_functional):
        assert is_impure(op.default)  # what FX and Inductor consult before removing a node
        assert _get_effect(op.default) is None  # ordered by the token instead (no with_effects)
    assert not is_impure(torch.ops.torchleaf.backward.default)


def test_reparametrize_module_takes_the_arguments_torchleaf_passes():
    from torch.nn.utils.stateless import _reparametrize_module

    params = inspect.signature(_reparametrize_module).parameters
    assert {"module", "parameters_and_buffers", "tie_weights", "strict"} <= set(params)
    lin = torch.nn.Linear(2, 2)
    w = torch.zeros(2, 2)
    with _reparametrize_module(lin, {"weight": w, "bias": torch.ones(2)}, tie_weights=False, strict=True):
        assert lin.weight is w
    assert isinstance(lin.weight, torch.nn.Parameter)


def test_compile_cache_key_tag_carries_the_operator_schema_version():
    tag = torch.compiler.config.cache_key_tag
    assert f"torchleaf-ops-v{torchleaf._C.OPERATOR_SCHEMA_VERSION}" in tag.split(";")


def test_dynamo_tells_a_higher_order_operator_body_from_the_top_level():
    # torchleaf._leaf._tracing_a_subgraph: InstructionTranslator.current_tx()
    # and the output graph's current_tracer.parent.
    from torch.utils.checkpoint import checkpoint

    from torchleaf._torch_private import dynamo_traces_a_subgraph as _tracing_a_subgraph

    seen = []

    @torch._dynamo.assume_constant_result
    def record():
        seen.append(_tracing_a_subgraph())  # assume_constant_result only marks the function
        return 0

    def body(x):
        return x * (1 + record())

    f = torch.compile(lambda x: checkpoint(body, x, use_reentrant=False) + record(), backend="eager", fullgraph=True)
    f(torch.ones(2, requires_grad=True))
    assert True in seen and False in seen


def test_dynamo_has_one_output_graph_per_trace():
    # torchleaf._leaf._first_ordered_call keys "the graph being traced" on
    # the identity of InstructionTranslator.current_tx().output: the same
    # object for every call within one trace, another for the next trace.
    from torch._dynamo.symbolic_convert import InstructionTranslator

    seen = []

    @torch._dynamo.assume_constant_result
    def record():
        seen.append(InstructionTranslator.current_tx().output)
        return 0

    f = torch.compile(lambda x: x + record() + record(), backend="eager", fullgraph=True)
    f(torch.ones(2))
    torch._dynamo.reset()
    f(torch.ones(3))
    assert len(seen) == 4 and seen[0] is seen[1] and seen[2] is seen[3] and seen[0] is not seen[2]


def test_functorch_wrapping_helpers_round_trip():
    # torchleaf._functorch stacks per-sample state handles that lower vmap
    # and grad levels wrap, with these helpers.
    from torch._C import _functorch as F

    seen = {}

    def probe(x):
        level = F.maybe_get_level(x)
        seen["level"] = level
        seen["batched"] = F.is_batchedtensor(x)
        plain, bdim = F._unwrap_batched(x, level)
        seen["plain"] = (plain.shape, bdim)
        rewrapped = F._add_batch_dim(plain, bdim, level)
        return rewrapped * 1

    x = torch.arange(6.0).view(2, 3)
    torch.testing.assert_close(torch.func.vmap(probe)(x), x)
    assert seen["batched"] and seen["level"] >= 1 and seen["plain"] == (torch.Size([2, 3]), 0)
    assert F.maybe_get_level(x) == -1

    def grad_probe(y):
        level = F.maybe_get_level(y)
        assert F.is_gradtrackingtensor(y)
        inner = F._unwrap_for_grad(y, level)
        assert F.maybe_get_level(inner) == -1
        return (F._wrap_for_grad(inner, level) * 0 + y).sum() * 2

    torch.testing.assert_close(torch.func.grad(grad_probe)(torch.ones(3)), torch.full((3,), 2.0))


def test_pytree_broadcast_to_and_flatten():
    # A leaf's own vmap rule may give one out_dim for all outputs.
    from torch.utils._pytree import _broadcast_to_and_flatten, tree_structure

    spec = tree_structure((1, [2, 3]))
    assert _broadcast_to_and_flatten(0, spec) == [0, 0, 0]
    assert _broadcast_to_and_flatten((0, [None, 1]), spec) == [0, None, 1]
    assert _broadcast_to_and_flatten((0, 1), spec) == [0, 1, 1]
    assert _broadcast_to_and_flatten((0, 1, 2), spec) is None  # structure mismatch


def test_treespec_json_round_trips():
    # Exported named Python leaves carry their call structure this way.
    from torch.utils._pytree import tree_structure, treespec_dumps, treespec_loads

    spec = tree_structure(((0, [1, 2]), {"scale": 3, "mode": 4}))
    text = treespec_dumps(spec)
    assert isinstance(text, str)
    assert treespec_loads(text) == spec


def test_backward_stashes_its_python_context_where_compiled_backwards_enter_it():
    """torchleaf's replay sets aside the thread-local object "context" that
    PyTorch's backward stashes and AOTAutograd's compiled backward enters
    (csrc/capture.cpp, PythonContextSetAside): a replay inside a compiled
    backward that reaches another compiled backward would enter it twice
    (test_training_stack.py::test_body_calls_a_compiled_function fails with
    "cannot enter context" if the set-aside stops working)."""
    seen = []

    def hook(grad):
        seen.append(torch._C._is_key_in_tls("context") and torch._C._get_obj_in_tls("context"))
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    import contextvars

    assert len(seen) == 1 and isinstance(seen[0], contextvars.Context)
    assert not torch._C._is_key_in_tls("context")  # erased after the backward


def test_autocast_state_queries():
    """A compiled call records the autocast state it was traced under
    (_leaf._autocast_state) with these, and enters it around its fake and
    real function."""
    assert "cpu" in torch._C._autocast_supported_devices()
    assert not torch._C._is_any_autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert torch._C._is_any_autocast_enabled()
        from torchleaf import _runner

        assert _runner.autocast_state() == ((("cpu", torch.bfloat16),), False)
    assert _runner.autocast_state() is None


def test_set_grad_enabled_sets_the_mode_and_returns_nothing():
    """A compiled call traced with grad mode on runs its real function with it
    on where AOTAutograd turned it off (_leaf._run_real), through this."""
    was = torch.is_grad_enabled()
    try:
        assert torch._C._set_grad_enabled(False) is None
        assert not torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        assert torch.is_grad_enabled()
    finally:
        torch._C._set_grad_enabled(was)


def test_an_op_overload_calls_and_hashes_through_its_op_attribute():
    # torchleaf replaces OpOverload._op of torchleaf::call/forward/backward
    # with direct entries (csrc/python/operator_entries.cpp), before anything
    # hashes the overloads. If OpOverload stops calling `_op`, compiled graphs
    # stay correct but lose the direct entries' speed; if it stops hashing
    # by `_op`, the replacement would no longer need to come first.
    lib = torch.library.Library("torchleaf_private_api_op", "FRAGMENT")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.torchleaf_private_api_op.double.default
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    calls = []

    def entry(*args, **kwargs):
        calls.append(args)
        return replaced(*args, **kwargs)

    before = hash(op)
    replaced, op._op = op._op, entry
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert len(calls) == 1
    # The release switch torchleaf keeps: whether the hash follows `_op`.
    from torchleaf._torch_private import OP_OVERLOAD_HASHES_BY_OP

    assert (hash(op) == hash(entry)) is OP_OVERLOAD_HASHES_BY_OP
    assert (hash(op) == before) is not OP_OVERLOAD_HASHES_BY_OP
    lib._destroy()


@pytest.mark.slow
def test_inductor_lowers_capturing_operators_through_the_wrapped_fallback():
    """torchleaf wraps the fallback lowering Inductor makes for forward and
    adds each call's input buffers to V.graph.never_reuse_buffers
    (_inductor.keep_captured_inputs). This checks the pieces it uses and that
    the generated code passes the forward's input buffer to no later kernel
    (test_seam.py's Inductor tests check the gradients)."""
    from torch._inductor import lowering
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import run_and_get_code
    from torch._library.utils import get_layout_constraint_tag

    from torchleaf import _inductor

    assert callable(lowering.make_fallback) and callable(lowering.tag_to_layout_constraint)
    assert callable(get_layout_constraint_tag)
    # _copy_inputs_written_later: the graph module the FX node being lowered
    # belongs to, and aten.clone's lowering.
    assert issubclass(GraphLowering, torch.fx.Interpreter)  # .module: the graph's GraphModule
    assert torch.ops.aten.clone.default in lowering.lowerings

    leaf = torchleaf.leaf_function(torch.sin)
    leaf.register_fake(torch.empty_like)
    torch._dynamo.reset()
    f = torch.compile(lambda x: (leaf(x[0] * 2) + leaf(x[1] * 2)).sum(), backend="inductor", fullgraph=True)
    x = torch.randn(2, 3, requires_grad=True)
    _, (forward_code, *_) = run_and_get_code(f, x)
    assert _inductor._inductor_lowerings_installed
    assert torch.ops.torchleaf.forward.default in lowering.lowerings
    assert "torch.ops.torchleaf.forward.default" in forward_code
    assert "# reuse" not in forward_code, forward_code


def test_rng_state_wrappers_find_a_capturing_operators_device():
    """Compiled activation checkpointing wraps a recomputed operator tagged
    nondeterministic_seeded in run_and_save_rng_state / run_with_rng_state,
    which pick the generator with rng_prims.get_device (a module global their
    backend-select kernels look up when called); torchleaf wraps it to look
    in list arguments (_ops._let_rng_state_wrappers_find_listed_tensors),
    and Inductor's lowerings of both wrappers
    (test_training_stack.py::test_checkpointing_recomputes_a_random_body_with_the_forwards_numbers
    checks the recomputation's random numbers)."""
    from torch._inductor import lowering
    from torch._prims import rng_prims

    from torchleaf import _inductor

    for name in ("forward", "forward_mutating", "forward_functional"):
        assert torch.Tag.nondeterministic_seeded in getattr(torch.ops.torchleaf, name).default.tags
    assert getattr(rng_prims.get_device, "_torchleaf", False)
    x = torch.ones(2)
    assert rng_prims.get_device((1, 2, [x], [0]), {}) == "cpu"
    assert rng_prims.get_device((x,), {}) == "cpu"
    assert rng_prims.run_and_save_rng_state in lowering.lowerings
    assert rng_prims.run_with_rng_state in lowering.lowerings
    _inductor.keep_captured_inputs()
    assert _inductor._inductor_lowerings_installed
    for wrapper in (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state):
        assert hasattr(lowering.lowerings[wrapper], "__wrapped__")  # torchleaf's keep_inputs


def test_inductor_skips_the_size_asserts_torchleaf_marks():
    """torchleaf drops Inductor's size and stride asserts of the state handle
    and of the backward operator's gradients (_inductor._skip_size_check):
    it sets MultiOutput.skip_size_stride_alignment_checks on those outputs,
    and removes the handle's entry from the wrapper's _pending_input_asserts
    after PythonWrapperCodegen.codegen_input_size_asserts made them.
    test_compile.py::test_inductor_checks_no_size_the_core_guarantees checks
    the generated code."""
    from torch._inductor import ir, lowering  # noqa: F401 (installs torchleaf's wrappers below)
    from torch._inductor.codegen import wrapper

    from torchleaf import _inductor

    assert "skip_size_stride_alignment_checks" in inspect.signature(ir.MultiOutput.__init__).parameters
    _inductor.keep_captured_inputs()
    assert hasattr(wrapper.PythonWrapperCodegen.codegen_input_size_asserts, "__wrapped__")


def test_checkpointing_pack_hooks_are_recognized():
    """torchleaf keeps no state for copies of a handle under non-reentrant
    checkpointing's saved-tensor hooks, which save nothing or the tensor
    itself (_ops._saved_hook_may_copy). It recognizes them by
    module and qualified name, so a renamed hook would bring back the leak
    test_training_stack.py::test_eager_checkpointing_around_a_compiled_region_keeps_no_state
    catches."""
    from torch.utils import checkpoint

    from torchleaf import _ops

    seen = []

    def record(x):
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        seen.append(None if hooks is None else hooks[0])
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    checkpoint.checkpoint(record, x, use_reentrant=False).sum().backward()
    forward_hook, recompute_hook = seen
    assert not _ops._saved_hook_may_copy(forward_hook)
    assert not _ops._saved_hook_may_copy(recompute_hook)
    assert _ops._saved_hook_may_copy(lambda t: t.clone())
    with torch.autograd.graph.save_on_cpu():
        (pack, _), = [torch._C._autograd._top_saved_tensors_default_hooks(True)]
    assert _ops._saved_hook_may_copy(pack)


def test_design_lists_exactly_the_private_api_layer():
    """docs/design.md's table of private PyTorch APIs (Python) names exactly
    what python/torchleaf/_torch_private.py holds, and no other module of
    torchleaf imports a private PyTorch name."""
    import os
    import re

    from torchleaf import _torch_private

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    design = open(os.path.join(root, "docs", "design.md")).read()
    section = design.split("### Python (`python/torchleaf/_torch_private.py`)")[1].split("###")[0]
    listed = set(re.findall(r"^\| `([A-Za-z_]+)` \|", section, re.M))
    assert listed == set(_torch_private.__all__)
    # C++: the header's machine-readable list, row for row.
    header = open(os.path.join(root, "csrc", "torch_private.h")).read()
    in_header = re.findall(r"^// PRIVATE-API: (.+?) — ", header, re.M)
    cpp_section = design.split("### C++ (`csrc/torch_private.h`)")[1].split("## ")[0]
    assert re.findall(r"^\| `(.+?)` \|", cpp_section, re.M) == in_header
    package = os.path.dirname(_torch_private.__file__)
    for name in os.listdir(package):
        if name.endswith(".py") and name != "_torch_private.py":
            source = open(os.path.join(package, name)).read()
            found = re.findall(r"^\s*(?:from|import) torch\S*\._\w+|(?<![\w.])torch\._[A-Za-z]\w*", source, re.M)
            assert not found, (name, found)
