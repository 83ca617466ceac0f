"""Leaf-heavy models as large-model trainers write them: many modules of one
structure through one compiled function, blocks compiled one by one, fresh
modules that torchleaf never saw, compared with the same model without
torchleaf (values, gradients, frames compiled, ``.grad is None``)."""

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import torchleaf
from torchleaf import LeafFunctionError


class Block(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.lin(x)).relu()


def residual(block, x):
    return block(x) + x


leaf_residual = torchleaf.leaf_function(residual)
leaf_residual.register_fake(lambda block, x: torch.empty_like(x))


class Wrapped(nn.Module):
    """One block and the function its forward calls (the leaf, or the plain
    function)."""

    def __init__(self, block, fn):
        super().__init__()
        self.block, self.fn = block, fn

    def forward(self, x):
        return self.fn(self.block, x)


def _grads(module):
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_fresh_modules_of_one_structure_share_one_graph(backend):
    """32 modules that no eager call saw first, through one compiled function
    with fullgraph=True: one frame, as the plain function compiles (Dynamo's
    recompile limit is 8: a graph per module failed at the 9th)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [Block() for _ in range(32)]
    plain = copy.deepcopy(blocks)
    x = torch.randn(3, 4)
    counts = {}
    for name, fn, modules in (("leaf", leaf_residual, blocks), ("plain", residual, plain)):
        counter = CompileCounterWithBackend(backend)
        step = torch.compile(lambda m, x, fn=fn: fn(m, x).square().sum(), backend=counter, fullgraph=True)
        for m in modules:
            step(m, x).backward()
        counts[name] = counter.frame_count
    assert counts["leaf"] == counts["plain"] == 1
    for got, want in zip(blocks, plain):
        for a, b in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)  # (Inductor fuses differently)
    # Modules of another structure get a graph of their own, as in plain code.
    wide = Block(width=6)
    counter = CompileCounterWithBackend(backend)
    step = torch.compile(lambda m, x: leaf_residual(m, x).sum(), backend=counter, fullgraph=True)
    step(blocks[0], x)
    for m in (wide, Block(width=6)):
        torch.testing.assert_close(step(m, torch.ones(2, 6)), residual(m, torch.ones(2, 6)).sum())
    assert counter.frame_count == 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_blocks_compiled_one_by_one(backend):
    """Per-block compilation (each block's forward compiled on its own, the
    pattern of FSDP trainers): frames as many as the plain model's, values
    and gradients equal to it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [Block() for _ in range(32)]
    models = {
        "leaf": nn.Sequential(*[Wrapped(b, leaf_residual) for b in blocks]),
        "plain": nn.Sequential(*[Wrapped(copy.deepcopy(b), residual) for b in blocks]),
    }
    x = torch.randn(3, 4, requires_grad=True)
    frames, outs = {}, {}
    for name, model in models.items():
        counter = CompileCounterWithBackend(backend)
        for w in model:
            w.compile(backend=counter, fullgraph=True)
        out = model(x)
        out.square().sum().backward()
        frames[name], outs[name] = counter.frame_count, out
    assert frames["leaf"] == frames["plain"] <= 2  # (the first block's input does not require grad)
    torch.testing.assert_close(outs["leaf"], outs["plain"], rtol=1e-4, atol=1e-4)
    for a, b in zip(models["leaf"].parameters(), models["plain"].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


def test_a_freshly_loaded_checkpoint_runs_compiled_as_itself():
    """A model built and loaded after the function was compiled (a checkpoint
    restored mid-run): the compiled function runs on its weights, without a
    new graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda m, x: leaf_residual(m, x), backend=counter, fullgraph=True)
    x = torch.randn(3, 4)
    first = Block()
    torch.testing.assert_close(step(first, x), residual(first, x))
    saved = {k: v * 3 for k, v in first.state_dict().items()}
    restored = Block()
    restored.load_state_dict(saved)
    torch.testing.assert_close(step(restored, x), residual(restored, x))
    assert not torch.allclose(residual(restored, x), residual(first, x))
    assert counter.frame_count == 1


def test_modules_that_share_every_tensor_but_differ_are_a_clear_error():
    """Two modules that share all their tensors (copy.copy of one torchleaf
    never saw) and differ in another attribute: a compiled call, which finds
    its module by its tensors, cannot tell which it got, and says so."""
    torch._dynamo.reset()

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)
            self.scale = 1.0

        def forward(self, x):
            return self.lin(x) * self.scale

    run = torchleaf.leaf_function(lambda m, x: m(x))
    run.register_fake(lambda m, x: x.new_empty(x.shape[0], 1))
    f = torch.compile(lambda m, x: run(m, x), backend="aot_eager", fullgraph=True)
    original, x = Scaled(), torch.randn(2, 3)
    twin = copy.copy(original)
    torch.testing.assert_close(f(twin, x), twin(x))  # alike: either serves
    twin.scale = 10.0
    with pytest.raises(LeafFunctionError, match=r"share the tensors of this call, differing in 'scale'.*copy.deepcopy"):
        f(twin, x)
    torch.testing.assert_close(run(twin, x), twin(x))  # eager calls have the module itself


def test_no_module_state_outlives_its_module():
    """The index of modules compiled calls find holds them weakly: a model
    freed after compiled calls is gone, its parameters with it."""
    import gc
    import weakref

    torch._dynamo.reset()
    step = torch.compile(lambda m, x: leaf_residual(m, x), backend="aot_eager", fullgraph=True)
    block = Block()
    step(block, torch.randn(2, 4))
    refs = [weakref.ref(block), weakref.ref(block.lin.weight)]
    del block
    gc.collect()
    assert all(r() is None for r in refs)


class MixtureOfExperts(nn.Module):
    """Top-1 routing over four experts: a batch that reaches only some experts
    leaves the others idle, and AdamW must leave them alone."""

    def __init__(self, width=4, n_experts=4):
        super().__init__()
        self.gate = nn.Linear(width, n_experts)
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(n_experts)])

    def forward(self, x):
        return route(self, x)


def route(moe, x):
    choice = moe.gate(x).argmax(-1)
    out = torch.zeros_like(x)
    for i in choice.unique().tolist():  # data-dependent: a leaf's job
        rows = choice == i
        out[rows] = moe.experts[i](x[rows]) * moe.gate(x[rows]).softmax(-1)[:, i : i + 1]
    return out


leaf_route = torchleaf.leaf_function(route)
leaf_route.register_fake(lambda moe, x: torch.empty_like(x))


def test_an_idle_expert_keeps_no_gradient_under_adamw():
    """Eager calls give no gradient (None) to parameters the captured graph
    does not reach, as plain code: after 30 AdamW steps with weight decay an
    idle expert is unchanged and the model equals the plain one."""
    torch.manual_seed(0)
    plain = MixtureOfExperts()
    leafy = copy.deepcopy(plain)
    leafy.forward = lambda x: leaf_route(leafy, x)
    with torch.no_grad():  # a gate that never picks expert 3
        for model in (plain, leafy):
            model.gate.bias[3] = -1e4
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, leafy)]
    idle = leafy.experts[3].weight.detach().clone()
    for _ in range(30):
        x = torch.randn(8, 4)
        for model, opt in zip((plain, leafy), optimizers):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        assert [p.grad is None for p in leafy.parameters()] == [p.grad is None for p in plain.parameters()]
    assert leafy.experts[3].weight.grad is None
    torch.testing.assert_close(leafy.experts[3].weight, idle, rtol=0, atol=0)
    for a, b in zip(leafy.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_inductor_compiles_no_kernel_per_module():
    """The compile work of a leaf-heavy model does not grow with its module
    count beyond its operator calls: Inductor generates the same kernels for
    2 blocks as for 8 (a constant handle per fresh module was one kernel
    each, 100 of them in a 100-layer model, 5x plain code's cold compile)."""
    from torch._inductor.utils import run_and_get_code

    def kernels(n):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(*[Wrapped(Block(), leaf_residual) for _ in range(n)])
        x = torch.randn(3, 4)
        compiled = torch.compile(lambda x: model(x).square().sum(), backend="inductor", fullgraph=True)
        _, code = run_and_get_code(lambda: compiled(x).backward())
        text = "\n".join(code)
        assert text.count("torch.ops.torchleaf.forward.default(") == n  # (a training graph's)
        return text.count("async_compile.cpp"), text.count("cpp_fused_full")

    assert kernels(2) == kernels(8)
    assert kernels(8)[1] == 0


def test_a_fresh_modules_fake_runs_on_a_module_of_its_shapes():
    """Every nn.Linear has one structure (weight, bias); a fake that reads a
    setting (out_features) must run on a module with the call's shapes,
    also when the only other Linear torchleaf knows is another size and the
    call's module is fresh (a DDP copy in a tutorial got the other one's
    out_features and a wrong output shape)."""
    torch._dynamo.reset()
    project = torchleaf.leaf_function(lambda h, head: head(h))
    project.register_fake(lambda h, head: h.new_empty(h.shape[0], head.out_features))
    seen = nn.Linear(8, 8)
    project(torch.randn(2, 8), seen)  # known, other shapes
    fresh = nn.Linear(32, 3)
    f = torch.compile(lambda h, head: project(h, head), backend="aot_eager", fullgraph=True)
    h = torch.randn(2, 32)
    torch.testing.assert_close(f(h, fresh), fresh(h))


def test_compiled_functional_call_runs_on_the_calls_tensors():
    """torch.func.functional_call under torch.compile: the leaf's module gets
    tensors that are no module's own; it runs on a module of the structure
    with the call's tensors (all live ones agreeing), and says once that
    such calls search for it."""
    from torch.func import functional_call

    torch._dynamo.reset()
    leaf = torchleaf.leaf_function(lambda m, x: m(x))
    leaf.register_fake(lambda m, x: x.new_empty(x.shape[0], 3))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return leaf(self.lin, x)

    head, x = Head(), torch.randn(2, 4)
    params = {k: v * 2 for k, v in head.named_parameters()}
    f = torch.compile(lambda p, x: functional_call(head, p, (x,)), backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match=r"whose tensors are no live module's own \(torch.func.functional_call"):
        out = f(params, x)
    torch.testing.assert_close(out, x @ params["lin.weight"].T + params["lin.bias"])


def test_modules_tied_by_one_tensor_run_as_themselves():
    """Two modules of one structure that share only their first tensor (a
    tied weight) and differ in a setting: each compiled call runs on its own
    module, the one torchleaf never saw included."""
    torch._dynamo.reset()

    class Scaled(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = scale

        def forward(self, x):
            return self.lin(x) * self.scale

    run = torchleaf.leaf_function(lambda m, x: m(x))
    run.register_fake(lambda m, x: torch.empty_like(x))
    f = torch.compile(lambda m, x: run(m, x), backend="aot_eager", fullgraph=True)
    seen, x = Scaled(1.0), torch.randn(2, 3)
    torch.testing.assert_close(f(seen, x), seen(x))
    tied = Scaled(3.0)
    tied.lin.weight = seen.lin.weight  # first tensor shared, bias its own
    for m in (tied, seen, tied):
        torch.testing.assert_close(f(m, x), m(x))
