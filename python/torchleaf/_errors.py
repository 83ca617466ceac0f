class LeafFunctionError(RuntimeError):
    """Raised by torchleaf when a leaf function is defined or used wrongly.

    The message names the leaf function and says how to fix the problem.
    """
