#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torchleaf::python {

// Adds the per-call dict-entry functions of module arguments to `m`
// (same_entries, swap_entries, restore_entries, tensor_versions). See
// module_entries.cpp.
void add_module_entry_functions(pybind11::module_& m);

} // namespace torchleaf::python
