"""torchleaf's error type, and how errors name what they are about."""

import functools


class LeafFunctionError(RuntimeError):
    """Raised by torchleaf when a leaf function is defined or used wrongly.

    The message names the leaf function, what was wrong (and which argument)
    and how to fix it; docs/errors.md lists each error with its cause. It is
    a ``RuntimeError``, so code that catches PyTorch's errors catches it too.

    Example:
        >>> try:                                           # doctest: +SKIP
        ...     torch.compile(model, fullgraph=True)(x)
        ... except torchleaf.LeafFunctionError as e:
        ...     print(e)  # "torchleaf: leaf function 'gate' ..."
    """


def add_note(e: BaseException, note: str) -> None:
    """Add ``note`` to exception ``e`` once (what raised inside which leaf)."""
    notes = getattr(e, "__notes__", ())
    if note not in notes and hasattr(e, "add_note"):
        e.add_note(note)


def function_name(fn) -> str:
    """'module.qualname' of a function, a builtin or a functools.partial."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    module = getattr(target, "__module__", None) or type(target).__module__
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    return f"{module}.{name}" + (" (partial)" if target is not fn else "")
