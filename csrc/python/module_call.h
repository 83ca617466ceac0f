#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torchleaf::python {

// Adds call_found_module and call_bound_module, the common call of a Python
// leaf with a module argument (compiled, eager), to `m`. See module_call.cpp.
void add_module_call(pybind11::module_& m);

} // namespace torchleaf::python
