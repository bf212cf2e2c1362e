# `make run` runs the main job; `make test` the tests (slow ones aside), `make test-slow` the
# slow tests and the native core under sanitizers (CI runs both); each installs the package first.
PYTHON ?= python3
SYSTEM_PYTHON := $(PYTHON)

# A distribution's Python refuses pip installs outside a venv (PEP 668, "externally managed"):
# there everything goes into ./.venv, which still sees the system's packages (torch too).
EXTERNALLY_MANAGED := $(shell $(PYTHON) -c 'import os, sys, sysconfig; print(int(sys.prefix == sys.base_prefix and os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))' 2>/dev/null)
ifeq ($(EXTERNALLY_MANAGED),1)
override PYTHON := $(CURDIR)/.venv/bin/python
VENV := $(PYTHON)
endif

PIP = $(PYTHON) -m pip install -q --disable-pip-version-check
# Build tools from PyPI where the machine has none: cuda.h comes from nvidia-cuda-runtime-cu12
# (no CUDA toolkit needed), the long description from hatch-fancy-pypi-readme (pyproject.toml),
# cmake and ninja only when not installed already.
BUILD_TOOLS := scikit-build-core nvidia-cuda-runtime-cu12 hatch-fancy-pypi-readme $(if $(shell command -v cmake),,cmake) $(if $(shell command -v ninja),,ninja)
CMAKE = $(shell command -v cmake || $(PYTHON) -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')

SANITIZE_asan := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SANITIZE_tsan := -fsanitize=thread

.PHONY: install run test test-slow lint docs sanitize sanitize-asan sanitize-tsan wheel wheel-test

$(CURDIR)/.venv/bin/python:
	$(SYSTEM_PYTHON) -m venv --system-site-packages .venv

# The package in editable mode with the extras the target needs: the example's alone (its
# plots and progress bar) for make run, the test tools too otherwise.
EXTRAS = test,examples
run: EXTRAS = examples

install: $(VENV)
	$(PIP) $(BUILD_TOOLS)
	$(PIP) --no-build-isolation -e ".[$(EXTRAS)]"

run: install
	$(PYTHON) examples/rl_example.py

# In parallel (pytest-xdist; tests/conftest.py picks the number of workers: one per core up
# to 4 without a GPU, none with one). Tests marked `slow` are make test-slow's.
PYTEST = $(PYTHON) -m pytest -q -n auto --dist worksteal
test: install
	$(PYTEST) -m "not slow" tests

# The sanitizer builds and runs beside the slow tests: those end in a few long tests that
# leave a core idle (a lone worker), which the compiler and the sanitized core use.
test-slow: install
	mkdir -p build; $(MAKE) --no-print-directory sanitize > build/sanitize.log 2>&1 & sanitize=$$!; \
	$(PYTEST) -m slow tests; tests=$$?; \
	wait $$sanitize; sanitized=$$?; cat build/sanitize.log; \
	[ $$sanitized -eq 0 ] || echo "make test-slow: the sanitizers failed (build/sanitize.log above)" >&2; \
	[ $$tests -eq 0 ] && [ $$sanitized -eq 0 ]

# The developers' tools are pyproject.toml's dependency groups, which pip installs from 25.1 on.
GROUP = $(PIP) "pip>=25.1" && $(PIP) --group

# ruff over the Python code and mypy over the package (settings in pyproject.toml).
lint: install
	$(GROUP) lint
	$(PYTHON) -m ruff check torch_mem_saver_lite tests examples benchmarks
	$(PYTHON) -m mypy

# The documentation site into site/ (mkdocs.yml), a warning failing the build. The API page is
# read from the source, so nothing needs building first.
docs: $(VENV)
	$(GROUP) docs
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

# The core's native tests under AddressSanitizer+UBSan and under ThreadSanitizer.
sanitize: sanitize-asan sanitize-tsan

sanitize-asan sanitize-tsan: sanitize-%:
	$(CMAKE) -S . -B build/$* -DCMAKE_BUILD_TYPE=Debug -DTMSL_NATIVE_TESTS=ON -DCMAKE_CXX_FLAGS="$(SANITIZE_$*)" \
	  -DPython_EXECUTABLE="$(shell command -v $(PYTHON))" > /dev/null
	$(CMAKE) --build build/$* --target tmsl_core_test -j 2 > /dev/null
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 TSAN_OPTIONS=halt_on_error=1 build/$*/tmsl_core_test

# The portable wheel (manylinux, built with zig from PyPI: no toolkit, no Docker) into dist/,
# then installed into a fresh venv with torch at the declared floor and host-tested there.
wheel:
	PYTHON=$(SYSTEM_PYTHON) tools/build_wheel.sh x86_64 dist

wheel-test: wheel
	PYTHON=$(SYSTEM_PYTHON) tools/test_wheel.sh dist/torch_mem_saver_lite-*manylinux_*_x86_64.whl
