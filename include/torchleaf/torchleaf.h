#pragma once

// torchleaf: leaf functions for PyTorch. One header for the public C++ API.
#include <torchleaf/config.h>
#include <torchleaf/errors.h>
#include <torchleaf/leaf.h>
