#!/usr/bin/env bash
# Install a built wheel into a fresh venv, with torch at the lowest version the package
# declares (pyproject.toml's floor), check its library as shipped (it loads and exports no
# testing ABI), then run the host tests against that install.
#
# The host tests (the contract tests and pause/resume) run with the library's testing twin
# (tools/build_wheel.sh builds it: the same sources and compiler, plus the testing ABI the host
# tests' HostSaver needs) in the installed library's place.
#   tools/test_wheel.sh path/to/torch_mem_saver_lite-*.whl [torch requirement]
# The floor's torch on PyPI is its CUDA build: about 7 GB installed plus 4 GB of downloads
# (12 GB asked for, a little to spare).
# With less disk free than that, WHEEL_TEST_FALLBACK_TORCH (a requirement this machine can
# install from a local file, as CI's CPU torch) is tested instead, and the output says so;
# without it the script stops and says how much is missing.
#   tools/test_wheel.sh --download-floor DIR
# downloads the floor's torch wheels into DIR ahead (CI, while other tests run: the network's
# time, not the cores'), where the disk holds them besides the install (4 GB more); the test
# then installs from there with WHEEL_TEST_FIND_LINKS=DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^dependencies = \["torch>=\([0-9.]*\)"\]/\1/p' pyproject.toml)
needs_gb=${WHEEL_TEST_NEEDS_GB:-12}
gb_free() {
  # pip's downloads go to TMPDIR; both it and the venv must fit.
  ${PYTHON:-python3} -c 'import shutil, sys, tempfile
print(min(shutil.disk_usage(p).free for p in (sys.argv[1], tempfile.gettempdir())) // 2**30)' "$1"
}
if [ "${1:-}" = --download-floor ]; then
  mkdir -p "$2"
  if [ "$(gb_free "$2")" -lt $((needs_gb + 4)) ]; then
    echo "wheel-test: no room to download torch==$floor.0 ahead; the test downloads it, disk permitting"
    exit 0
  fi
  exec ${PYTHON:-python3} -m pip download -q --disable-pip-version-check --no-cache-dir -d "$2" "torch==$floor.0"
fi
wheel=$(realpath "$1")
torch_req=${2:-torch==$floor.0}
venv=$PWD/build/wheel-venv
arch=$(basename "$wheel" .whl | sed 's/.*_\(x86_64\|aarch64\)$/\1/')
twin=$PWD/build/wheel-testing-$arch/torch_mem_saver_lite/libtorch_mem_saver_lite.so
[ -f "$twin" ] || { echo "wheel-test: no testing twin at $twin: build the wheel with tools/build_wheel.sh" >&2; exit 1; }

rm -rf $venv && mkdir -p build
free_gb=$(gb_free build)
if [ -z "${2:-}" ] && [ "$free_gb" -lt "$needs_gb" ]; then
  if [ -z "${WHEEL_TEST_FALLBACK_TORCH:-}" ]; then
    echo "wheel-test: $torch_req needs about $needs_gb GB of disk, $free_gb GB is free." >&2
    echo "  Free some, or pass another torch requirement: tools/test_wheel.sh WHEEL 'torch==X'." >&2
    exit 1
  fi
  echo "wheel-test: NOT at the torch floor: $torch_req needs about $needs_gb GB of disk and" \
       "$free_gb GB is free; testing with $WHEEL_TEST_FALLBACK_TORCH instead."
  torch_req=$WHEEL_TEST_FALLBACK_TORCH
fi

${PYTHON:-python3} -m venv $venv
# No pip cache: it would keep a second copy of the gigabytes just installed.
# WHEEL_TEST_FIND_LINKS: a folder where the torch requirement's wheels were downloaded already.
$venv/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check \
  ${WHEEL_TEST_FIND_LINKS:+--find-links "$WHEEL_TEST_FIND_LINKS"} "$torch_req" "$wheel[test,examples]"
# The tests must see the installed wheel, not this checkout's package directory.
(cd / && $venv/bin/python -c '
import torch, torch_mem_saver_lite as t, torch_mem_saver_lite._lib as lib
assert "site-packages" in t.__file__, t.__file__
print(f"torch {torch.__version__}; torch_mem_saver_lite {t.__version__} from {t.__file__}")
lib.lib()
assert not lib.has_testing_abi(), "the wheel ships the testing ABI"
print("library:", lib.library_path())')
installed=$(cd / && $venv/bin/python -c 'import torch_mem_saver_lite._lib as lib; print(lib.library_path())')
${PYTHON:-python3} tools/check_exports.py "$installed" > /dev/null
cp "$twin" "$installed"
# pytest's console script does not put the working directory on sys.path either, and
# PYTHONSAFEPATH keeps it off for the Python processes the tests start. What the install can
# change is the contract (tests/contract/: the ABI, the API and its errors, the drop-in and
# its routes, the package, the environment), and pause/resume itself; every feature's tests
# ran against these same sources in make test already, so they are not run a second time here
# (that doubled CI's time). The slow tests build this checkout themselves.
PYTHONSAFEPATH=1 $venv/bin/pytest -q -p no:cacheprovider -m "not gpu and not slow" tests/contract \
  --ignore=tests/contract/test_install.py tests/features/test_pause_resume.py
# The venv is gigabytes and nothing reuses it.
rm -rf $venv
