"""Process-wide switches, stored in the C++ core (so C++ leaves see them too).

A leaf may override either per leaf (``leaf_function(validate_outputs=...)``,
``define_leaf``'s ``Config`` in C++).

Attributes:
    validate_outputs (bool): Compare each real call's outputs with the fake's
        (structure, shape, dtype, device) on every call. Off by default: it
        runs the fake a second time. Compiled calls always check what their
        graph relies on.
    check_escaped_gradients (bool): Fail when the real function's autograd
        graph reaches tensors that require grad but are not inputs (closures,
        globals), whose gradients would be lost. On by default.

Example:
    >>> torchleaf.config.validate_outputs = True                   # doctest: +SKIP
    >>> with torchleaf.config.patch(check_escaped_gradients=False): # doctest: +SKIP
    ...     y = leaf(x)
"""

import contextlib
import sys
import types

from . import _C

_FLAGS = {
    # Compare real and fake outputs (structure, shape, dtype, device) on every
    # call. Off by default: it runs the fake a second time.
    "validate_outputs": (_C.get_validate_outputs, _C.set_validate_outputs),
    # Fail when the real function's graph reaches tensors that require grad
    # but are not inputs (closures, globals). On by default.
    "check_escaped_gradients": (_C.get_check_escaped_gradients, _C.set_check_escaped_gradients),
}


class _ConfigModule(types.ModuleType):
    def __getattr__(self, name):
        if name in _FLAGS:
            return _FLAGS[name][0]()
        raise AttributeError(f"torchleaf.config has no flag {name!r}; flags: {sorted(_FLAGS)}")

    def __setattr__(self, name, value):
        if name in _FLAGS:
            _FLAGS[name][1](bool(value))
        else:
            super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_FLAGS))


@contextlib.contextmanager
def patch(**flags):
    """Set flags for the duration of a ``with`` block, then restore them.

    Args:
        **flags: ``validate_outputs`` and/or ``check_escaped_gradients``,
            each a bool.

    Yields:
        Nothing: the flags are set inside the block.

    Raises:
        AttributeError: A name that is not a flag.

    Example:
        >>> with torchleaf.config.patch(validate_outputs=True):  # doctest: +SKIP
        ...     y = leaf(x)
    """
    unknown = set(flags) - set(_FLAGS)
    if unknown:
        raise AttributeError(f"torchleaf.config has no flag(s) {sorted(unknown)}; flags: {sorted(_FLAGS)}")
    saved = {name: _FLAGS[name][0]() for name in flags}
    try:
        for name, value in flags.items():
            _FLAGS[name][1](bool(value))
        yield
    finally:
        for name, value in saved.items():
            _FLAGS[name][1](value)


sys.modules[__name__].__class__ = _ConfigModule
