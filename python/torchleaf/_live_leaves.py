"""Python leaves by id, weakly: what graphs, the C++ core and Dynamo's
trace-time functions name a leaf by."""

import weakref

#: id -> LeafFunction (registered by LeafFunction.__init__).
LEAVES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def leaf_of(leaf_or_id):
    """The leaf, given the leaf or its id: a function Dynamo calls for a
    constant result gets the id where the release cannot pass the leaf
    (_torch_private.CONSTANT_FUNCTIONS_TAKE_OBJECTS)."""
    return LEAVES[leaf_or_id] if type(leaf_or_id) is int else leaf_or_id
