#pragma once

// Symbol visibility for libtorchleaf.
#if defined(_WIN32)
#if defined(TORCHLEAF_BUILDING_LIBRARY)
#define TORCHLEAF_API __declspec(dllexport)
#else
#define TORCHLEAF_API __declspec(dllimport)
#endif
#else
#define TORCHLEAF_API __attribute__((visibility("default")))
#endif
