# torchleaf: `make demo` and `make test` work from a clean clone on a fresh
# machine; they install what is missing, build, and run.

PYTHON ?= python3
BUILD_DIR := build/py
PIP := $(PYTHON) -m pip install --disable-pip-version-check -q
DEB_PACKAGES := libgtest-dev libbenchmark-dev
# The test tools are bounded above by the releases the suite was last run with
# (pytest 9.2.0, pytest-randomly 5.1.0, hypothesis 6.170.27), so that a fresh
# machine gets tools the suite is known to pass with; keep pyproject.toml's
# `test` extra the same.
BUILD_DEPS := "pybind11>=2.12" "scikit-build-core>=0.10" ninja cmake
TEST_DEPS := "pytest>=8,<9.3" "pytest-randomly>=3.15,<5.2" "hypothesis>=6,<6.171" numpy
PY_DEPS := torch==2.13.0 $(BUILD_DEPS) $(TEST_DEPS) matplotlib

.PHONY: all deps deps-system build test test-cpp test-python test-wheel \
        demo bench bench-quick sanitize clean

all: build

deps-system:
	@dpkg -s $(DEB_PACKAGES) >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_PACKAGES) >/dev/null)

deps: deps-system
	@$(PYTHON) -c "import torch, pybind11, scikit_build_core, pytest, pytest_randomly, hypothesis, numpy, matplotlib; \
	  assert torch.__version__.startswith('2.13.0')" 2>/dev/null || $(PIP) $(PY_DEPS)

# Editable install; scikit-build-core drives CMake and builds libtorchleaf,
# torchleaf._C and the C++ tests in $(BUILD_DIR) (incremental on re-runs).
build: deps
	@$(PIP) --no-build-isolation --no-deps -e .

test: build test-cpp test-python

test-cpp:
	cd $(BUILD_DIR) && ctest --output-on-failure --timeout 600

# Only the wheel test (also part of test-cpp, as ctest `wheel`): builds the
# wheel in build/wheel, installs it into a fresh venv and uses it there.
test-wheel: deps
	PYTHON=$(PYTHON) tests/packaging/wheel_test.sh . build/wheel-test

# The Python suite runs in random order (pytest-randomly). The seed is printed
# first, also under -q (which hides pytest's header); rerun one order with
# `make test-python SEED=N`.
SEED ?=
test-python:
	@seed=$(SEED); seed=$${seed:-$$($(PYTHON) -c 'import random; print(random.randrange(2**32))')}; \
	echo "Using --randomly-seed=$$seed"; \
	TORCHLEAF_BUILD_DIR=$(abspath $(BUILD_DIR)) $(PYTHON) -m pytest tests/python benchmarks/test_quick.py -q \
	  -p randomly --randomly-seed=$$seed

demo: build
	$(PYTHON) examples/demo.py

# Valgrind counts instructions per call for BENCHMARKS.md (benchmarks/instructions.py),
# perf samples where the time goes (benchmarks/time_shares.py).
bench: build
	@dpkg -s valgrind linux-perf >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind linux-perf >/dev/null)
	TORCHLEAF_BUILD_DIR=$(abspath $(BUILD_DIR)) $(PYTHON) benchmarks/run.py

bench-quick: build
	TORCHLEAF_BUILD_DIR=$(abspath $(BUILD_DIR)) $(PYTHON) benchmarks/run.py --quick

# The C++ suite under AddressSanitizer + UBSan (LeakSanitizer included).
sanitize: deps
	cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORCHLEAF_SANITIZE=ON \
	  -DTORCHLEAF_BUILD_PYTHON=OFF -DTORCHLEAF_BUILD_TESTS=ON
	cmake --build build/asan
	cd build/asan && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=$(abspath tests/cpp/lsan.supp) \
	  ctest --output-on-failure

clean:
	rm -rf build
