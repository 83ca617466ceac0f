"""Named leaves and torch.export.

A leaf with a name (@leaf_function(name="ns::op")) is also the operator
ns::op(Tensor[] inputs, [Tensor(a!)[] mutated,] str call) -> Tensor[]: the
form in which it is exported. `call` describes the call's structure in
JSON (pytree spec, constants, which flat arguments are tensors, and the
module to import), so another process that imports that module can
rebuild the call; the core turns each distinct description into a plan of
the leaf bound to the name there (bound_named_ops.h), once.
"""

import json
import weakref

import torch

from . import _C
from ._classify import EXPORTED, MODULE_ARG, TENSOR_ARG, TRACED, classify
from ._errors import LeafFunctionError
from ._outputs import traced_output, traced_result
from ._plans import IN_TENSOR, TENSOR
from ._torch_private import assume_constant_result, inductor_is_lowering, pytree

_CALL_FORMAT = 1
# Live named leaves by name (weak: a leaf dies with its last user).
NAMED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _export_constant(leaf, value, position):
    if value is None or type(value) in (bool, int, float, str):
        return ["const", value]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value).removeprefix("torch.")]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    raise LeafFunctionError(
        f"torchleaf: leaf function '{leaf._name}' got a {type(value).__name__} as flat argument "
        f"{position} of an exported call; an exported program stores non-tensor arguments as "
        f"constants, which may be None, bool, int, float, str, torch.dtype or torch.device. Pass "
        f"it as a tensor, or as one of those."
    )


def _import_constant(item):
    kind, value = item
    if kind == "const":
        return value
    if kind == "dtype":
        return getattr(torch, value)
    return torch.device(value)


@assume_constant_result
def _describe_for_export(leaf, skeleton):
    """(call description, plan index, flat positions of tensors, flat positions
    of mutated tensors) of an exported call; ``skeleton``: the call's
    arguments with TENSOR for tensors. A constant of Dynamo's graph when
    export traces with Dynamo (strict mode)."""
    flat, spec = pytree.tree_flatten(skeleton)
    try:
        spec_json = pytree.treespec_dumps(spec)
    except Exception as e:  # e.g. a namedtuple or dataclass without serialization
        raise LeafFunctionError(
            f"torchleaf: leaf function '{leaf._name}' was exported with arguments whose structure "
            f"cannot be saved ({e}). Pass tensors and plain constants in tuples, lists and dicts."
        ) from None
    args = [["tensor"] if x is TENSOR else _export_constant(leaf, x, i) for i, x in enumerate(flat)]
    call = json.dumps(
        {"torchleaf": _CALL_FORMAT, "leaf": leaf._qualified_name, "import": leaf.__module__,
         "spec": spec_json, "args": args},
        separators=(",", ":"),
    )
    plan = leaf._plans.from_key(spec, tuple(flat), TRACED)
    tensors = tuple(slot.position for slot in plan.slots if slot.kind == IN_TENSOR)
    return call, plan.index, tensors, plan.mutated


def plan_for_call(leaf_id, call):
    """The core's resolver: the plan of leaf ``leaf_id`` for a call description."""
    try:
        desc = json.loads(call)
        name = desc["leaf"]
        if desc["torchleaf"] != _CALL_FORMAT:
            raise ValueError(f"format {desc['torchleaf']}, expected {_CALL_FORMAT}")
        spec = pytree.treespec_loads(desc["spec"])
        key = tuple(TENSOR if item[0] == "tensor" else _import_constant(item) for item in desc["args"])
    except Exception as e:
        raise LeafFunctionError(
            f"torchleaf: a named leaf operator received a call description it cannot read ({e}): "
            f"{call!r}. It was written by another torchleaf version or edited; export the program "
            f"again."
        ) from None
    leaf = NAMED.get(name)
    if leaf is None or leaf._id != leaf_id:
        raise LeafFunctionError(f"torchleaf: leaf function '{name}' is not defined in this process.")
    if spec.num_leaves != len(key):
        raise LeafFunctionError(
            f"torchleaf: leaf function '{name}' received a call description whose structure and "
            f"arguments disagree: {call!r}. Export the program again."
        )
    return leaf._plans.from_key(spec, key, TRACED).index


def named_fake(inputs, *rest):
    """The fake of every named Python leaf operator."""
    call = rest[-1]
    mutated = list(rest[0]) if len(rest) == 2 else []
    name = json.loads(call)["leaf"]
    leaf = NAMED.get(name)
    if leaf is None:
        raise LeafFunctionError(
            f"torchleaf: leaf function '{name}' is not defined in this process; import the module "
            f"that defines it (@torchleaf.leaf_function(name={name!r})) first."
        )
    return _C.run_fake(leaf._id, plan_for_call(leaf._id, call), list(inputs), mutated, inductor_is_lowering())


def exported_call(leaf, flat, spec):
    """A call traced by torch.export (strict or not): the leaf's named
    operator with the call's description."""
    if leaf._qualified_name is None:
        raise LeafFunctionError(
            f"torchleaf: Python leaf function '{leaf._name}' cannot be exported without a name: "
            f"an exported program must run in another process, which finds the leaf by its "
            f"operator name. Give it one, @torchleaf.leaf_function(name=\"mylib::op\"), and "
            f"import the module that defines it before torch.export.load; or define the leaf in "
            f"C++ (torchleaf::define_leaf)."
        )
    skeleton = []
    for x in flat:
        kind = classify(x, EXPORTED)
        if kind == TENSOR_ARG:
            skeleton.append(TENSOR)
        elif kind == MODULE_ARG:
            raise LeafFunctionError(
                f"torchleaf: leaf function '{leaf._name}' got a {type(x).__name__} argument in an "
                f"exported call; an exported program cannot rebuild a module in another process. "
                f"Pass the tensors the leaf needs (e.g. module.weight) instead."
            )
        else:
            skeleton.append(x)
    call, plan_index, positions, mutated_positions = _describe_for_export(
        leaf, pytree.tree_unflatten(skeleton, spec)
    )
    inputs = [flat[pos] for pos in positions]
    if leaf._signature.mutates_args:
        outputs = leaf._named_op(inputs, [flat[pos] for pos in mutated_positions], call)
    else:
        outputs = leaf._named_op(inputs, call)
    traced = traced_output(leaf, plan_index)
    return outputs[0] if traced is None else traced_result(leaf, traced, outputs)
