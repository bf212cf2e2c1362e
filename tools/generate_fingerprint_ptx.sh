#!/bin/sh
# Regenerates csrc/platform/fingerprint_kernel.ptx from fingerprint_kernel.cu: run after
# changing the kernel, on a machine with a CUDA toolkit (nvcc). The build and the users need
# none: the library carries the PTX text and the driver compiles it at run time. The PTX is
# declared at ISA 7.0 for sm_70, so drivers of CUDA 12 and 13 both take it (tests/features/test_fingerprint.py
# checks the text assembles where ptxas is found).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
src="$here/csrc/platform/fingerprint_kernel.cu"
out="$here/csrc/platform/fingerprint_kernel.ptx"
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
nvcc -ptx -arch=compute_75 -O3 -o "$tmp" "$src"
{
  echo "// Generated from fingerprint_kernel.cu by tools/generate_fingerprint_ptx.sh: do not edit."
  sed -e 's/^\.version .*/.version 7.0/' -e 's/^\.target .*/.target sm_70/' "$tmp" | grep -v "^// Compiler Build ID\|^// Cuda compilation tools\|^// Based on NVVM"
} > "$out"
echo "wrote $out"
