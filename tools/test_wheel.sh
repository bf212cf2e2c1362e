#!/usr/bin/env bash
# Install a built wheel into a fresh venv, with torch at the lowest version the package
# declares (pyproject.toml's floor), and run the host tests against that install.
#   tools/test_wheel.sh path/to/torch_mem_saver_lite-*.whl [torch requirement]
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(realpath "$1")
floor=$(sed -n 's/^dependencies = \["torch>=\([0-9.]*\)"\]/\1/p' pyproject.toml)
torch_req=${2:-torch==$floor.0}
venv=$PWD/build/wheel-venv

rm -rf $venv && ${PYTHON:-python3} -m venv $venv
$venv/bin/python -m pip install -q --disable-pip-version-check "$torch_req" "$wheel[test,examples]"
# The tests must see the installed wheel, not this checkout's package directory.
(cd / && $venv/bin/python -c '
import torch, torch_mem_saver_lite as t, torch_mem_saver_lite._lib as lib
assert "site-packages" in t.__file__, t.__file__
print(f"torch {torch.__version__}; torch_mem_saver_lite {t.__version__} from {t.__file__}")
print("library:", lib.library_path())')
# pytest's console script does not put the working directory on sys.path either, and
# PYTHONSAFEPATH keeps it off for the Python processes the tests start.
PYTHONSAFEPATH=1 $venv/bin/pytest -q -p no:cacheprovider -m "not gpu" tests
