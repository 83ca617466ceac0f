#!/usr/bin/env bash
# Builds examples/cpp against the installed torchleaf package with
# find_package(torchleaf) and runs it: the CMake package config works.
set -euo pipefail
src="$1"
work="$2"
python="${PYTHON:-python3}"
prefix=$("$python" -c 'import torch, torchleaf; print(torch.utils.cmake_prefix_path + ";" + torchleaf.cmake_prefix_path)')
cmake -S "$src/examples/cpp" -B "$work" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work" >/dev/null
"$work/leaf_example"
