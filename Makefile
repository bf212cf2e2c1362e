# `make run` runs the main job, `make test` the tests; both install the package first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install run test

install:
	$(PIP) scikit-build-core
	$(PIP) --no-build-isolation -e ".[test,examples]"

run: install
	$(PYTHON) examples/rl_example.py

test: install
	$(PYTHON) -m pytest -q tests
