// The C++ leaf that examples/aoti deploys. It is defined when the library
// aoti_example_leaves is loaded: from Python with torchleaf.load_library
// (to export and compile a model that calls it), and in the deployed C++
// program by linking that library, before the AOTInductor package is loaded.
#pragma once

#include <torchleaf/torchleaf.h>

namespace aoti_example {

// The leaf `aoti_example::clip_rows`: [x] -> [x with rows of norm > 1 scaled
// to norm 1, the rows' norms (N x 1)]. Its body branches on a value of the
// data (item()), which torch.export cannot trace: as a leaf it is one
// operator call in the exported graph, run for real in every process.
torchleaf::LeafFunction clip_rows();

} // namespace aoti_example
