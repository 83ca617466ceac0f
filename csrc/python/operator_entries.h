#pragma once

#include <string>

#include <torch/csrc/utils/pybind.h>

namespace torchleaf::python {

// A callable that calls the operator torchleaf::`name` ("call", "forward" or
// "backward") directly for plain positional arguments and calls `replaced`
// (the OpOverload's own `_op`) for anything else. See operator_entries.cpp.
pybind11::object direct_operator_entry(
    const std::string& name,
    pybind11::object replaced);

} // namespace torchleaf::python
