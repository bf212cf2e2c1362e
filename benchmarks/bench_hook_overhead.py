"""What the preload hook adds to cudaMalloc/cudaFree calls it only forwards.

    python benchmarks/bench_hook_overhead.py [--iterations 20000]

Builds hook_overhead.c, runs it with the library in LD_PRELOAD, and prints the runtime's
own time per operation, the time through the hook, and the median of the per-block
differences (real and hooked blocks alternate, so drift cancels). The runtime's own time
is the limit the hook is measured against.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from torch_mem_saver_lite import _lib


def libcudart_path() -> str:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                return line.split()[-1]
    raise SystemExit("libcudart is not loaded by torch (statically linked build?)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU available: this benchmark needs one", file=sys.stderr)
        return 1
    runtime = libcudart_path()
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "hook_overhead"
        subprocess.run(["cc", "-O2", "-o", str(program), str(Path(__file__).parent / "support" / "hook_overhead.c"),
                        "-ldl"], check=True)
        env = {**os.environ, "LD_PRELOAD": _lib.library_path()}
        result = subprocess.run([str(program), runtime, str(args.iterations)], capture_output=True,
                                text=True, env=env, timeout=600)
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return 1
    print(f"device: {torch.cuda.get_device_name()}   runtime: {runtime}")
    print(f"{'operation (outside regions)':>28} | {'runtime ns':>10} | {'via hook ns':>11} | {'added ns':>9}")
    for line in result.stdout.splitlines():
        label, real, hooked, added = line.split()
        print(f"{label.replace('_', ' '):>28} | {float(real):10.1f} | {float(hooked):11.1f} | {float(added):9.1f}")
    print("Target: under 1000 ns added per call (malloc+free rows are two calls).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
