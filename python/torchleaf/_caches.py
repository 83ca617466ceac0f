"""What torchleaf adds to the key of PyTorch's on-disk compile caches.

Inductor's FX graph cache and AOTAutograd's key a graph by its text (and by
``torch.compiler.config.cache_key_tag``, which both hash). A graph's text
shows a leaf call's operator, leaf id and plan index, but not which torchleaf
built the operators, nor what the leaf's fake gives. Both go into the tag.
"""

from __future__ import annotations

import hashlib
import os

import torch

from . import _C

_OPS_TAG = f"torchleaf-ops-v{_C.OPERATOR_SCHEMA_VERSION}"

#: TORCHLEAF_STABLE_IDS=1 gives Python leaves ids that do not depend on the
#: process (csrc/registry.cpp), so on-disk caches can be shared between runs.
STABLE_IDS = os.environ.get("TORCHLEAF_STABLE_IDS") == "1"

# What each traced fake gave in this process (STABLE_IDS only), and the tag
# as it was before torchleaf folded them in.
_fake_signatures: set[str] = set()
_tag_before_fakes: str | None = None


def _set_tag(parts: list[str]) -> None:
    torch.compiler.config.cache_key_tag = ";".join(p for p in parts if p)


def tag_operator_schema() -> None:
    """Keep artifacts of other torchleaf versions out: a graph that calls a
    C++ leaf shows the leaf's named operator, which does not change when
    torchleaf's own operators do."""
    tag = torch.compiler.config.cache_key_tag
    if _OPS_TAG not in tag.split(";"):
        _set_tag([tag, _OPS_TAG])


def fold_traced_fake(leaf_id: int, plan_index: int, outputs: list) -> None:
    """With STABLE_IDS, fold what a traced fake gave (each output's dtype,
    shape, device and layout) into the tag: a process whose leaf of that id
    has another fake (leaves of one name defined in another order, a fake
    edited between runs) then misses the cache instead of running code
    compiled for other outputs (issue 36: garbage float32 where float64 was
    expected). The tag covers every fake traced so far in the process, so a
    process that traced another set first misses: never a wrong hit."""
    global _tag_before_fakes
    signature = repr((
        leaf_id,
        plan_index,
        tuple(
            (str(t.dtype), tuple(map(str, t.shape)), str(t.device), str(t.layout))
            if isinstance(t, torch.Tensor) else (type(t).__name__, str(t))
            for t in outputs
        ),
    ))
    if signature in _fake_signatures:
        return
    _fake_signatures.add(signature)
    digest = hashlib.sha256("\n".join(sorted(_fake_signatures)).encode()).hexdigest()[:24]
    if _tag_before_fakes is None:
        _tag_before_fakes = torch.compiler.config.cache_key_tag
    _set_tag([_tag_before_fakes, f"torchleaf-fakes:{digest}"])
