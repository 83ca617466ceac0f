#!/usr/bin/env bash
# The wheel a user installs: builds it from the source tree (incrementally, in
# build/wheel, apart from the editable build), checks its contents, installs
# it with its dependencies (the building Python's torch release, from pip: a
# wheel runs only with the torch it was built against) into a fresh venv, and
# there imports it, runs a Python leaf eagerly and under torch.compile, and
# builds and runs examples/cpp with find_package(torchleaf).
#
# Usage: wheel_test.sh SOURCE_DIR WORK_DIR   (PYTHON: the building Python)
# Each step prints one line; a failing step prints its log and exits non-zero.
set -euo pipefail
src=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
python="${PYTHON:-python3}"
here="$src/tests/packaging"

# Nothing of the build environment may leak into the venv.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PIP_USER VIRTUAL_ENV
export PIP_DISABLE_PIP_VERSION_CHECK=1

rm -rf "$work/dist" "$work/venv" "$work/example" "$work/run" "$work/logs"
mkdir -p "$work/logs" "$work/run"
start=$SECONDS

step() {  # step NAME COMMAND...: runs COMMAND, its output to logs/NAME.log
  local name=$1 t0=$SECONDS
  shift
  if ! "$@" >"$work/logs/$name.log" 2>&1; then
    echo "FAILED: $name ($((SECONDS - t0)) s): $*"
    echo "---- $work/logs/$name.log (last 60 lines)"
    tail -n 60 "$work/logs/$name.log"
    exit 1
  fi
  echo "ok   $name ($((SECONDS - t0)) s)"
}

# 1. The wheel (pyproject.toml builds wheels in build/wheel, without tests).
step build-wheel "$python" -m pip wheel "$src" -w "$work/dist" --no-deps --no-build-isolation
wheel=$(ls "$work"/dist/torchleaf-*.whl)
step check-wheel "$python" "$here/check_wheel.py" "$wheel"

# 2. A fresh venv (no system site-packages), the wheel and its dependencies.
step venv "$python" -m venv "$work/venv"
vpython="$work/venv/bin/python"
torch_release=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')
step install "$vpython" -m pip install "$wheel" "torch==$torch_release"
export TORCHLEAF_EXPECTED_TORCH=$torch_release

# 3. Python, from an empty folder, isolated (-I: no script dir, no user site).
cd "$work/run"
step python-leaf "$vpython" -I "$here/check_installed.py"
grep -E '^(torchleaf|cmake_prefix_path) ' "$work/logs/python-leaf.log" | sed 's/^/     /' || true

# 4. The downstream C++ example, against the venv's torch and torchleaf only.
prefix=$("$vpython" -I -c 'import torch, torchleaf; print(torch.utils.cmake_prefix_path + ";" + torchleaf.cmake_prefix_path)' \
  2>"$work/logs/prefix.log") || { echo "FAILED: prefix"; cat "$work/logs/prefix.log"; exit 1; }
step cmake-example cmake -S "$src/examples/cpp" -B "$work/example" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$prefix"
found=$(sed -n 's/^torchleaf_DIR:PATH=//p' "$work/example/CMakeCache.txt")
case "$found" in
  "$work/venv/"*) ;;
  *) echo "FAILED: find_package(torchleaf) found $found, not the venv's package"; exit 1 ;;
esac
step build-example cmake --build "$work/example"
# Every torch and torchleaf library the example loads comes from the venv.
ldd "$work/example/leaf_example" >"$work/logs/ldd.log"
if grep -E 'lib(torchleaf|torch|torch_cpu|c10)\.so' "$work/logs/ldd.log" | grep -v -F "$work/venv/"; then
  echo "FAILED: leaf_example loads the libraries above from outside $work/venv"
  exit 1
fi
step run-example "$work/example/leaf_example"
sed 's/^/     /' "$work/logs/run-example.log"

rm -rf "$work/venv"  # ~0.9 GB; logs and the wheel stay
echo "wheel test passed in $((SECONDS - start)) s: $(basename "$wheel")"
