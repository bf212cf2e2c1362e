# `make run` runs the main job, `make test` the tests; both install the package first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

SANITIZE_asan := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SANITIZE_tsan := -fsanitize=thread

.PHONY: install run test sanitize sanitize-asan sanitize-tsan

install:
	$(PIP) scikit-build-core
	$(PIP) --no-build-isolation -e ".[test,examples]"

run: install
	$(PYTHON) examples/rl_example.py

test: install sanitize
	$(PYTHON) -m pytest -q tests

# The core's native tests under AddressSanitizer+UBSan and under ThreadSanitizer.
sanitize: sanitize-asan sanitize-tsan

sanitize-asan sanitize-tsan: sanitize-%:
	cmake -S . -B build/$* -DCMAKE_BUILD_TYPE=Debug -DTMSL_NATIVE_TESTS=ON -DCMAKE_CXX_FLAGS="$(SANITIZE_$*)" > /dev/null
	cmake --build build/$* --target tmsl_core_test -j 2 > /dev/null
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 TSAN_OPTIONS=halt_on_error=1 build/$*/tmsl_core_test
