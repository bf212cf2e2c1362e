"""What each tool's core adds to allocate, free, pause and resume, without a GPU.

    python benchmarks/bench_core_overhead.py [--allocations 256] [--blocks 41] [--tms-path DIR]

Builds core_overhead.c and the fake CUDA driver and runtime (tests/fake_cuda), then runs
torch_mem_saver_lite's CUDA backend, torch_memory_saver (when importable, or in --tms-path)
and the bare driver calls over the same fake, in alternating blocks of 2 MiB allocations.
Prints the time per allocation of each path, and, where valgrind is installed, the
instructions each executes per allocation (callgrind: the same count on every run and
machine, so differences of a few percent are real). The fake's own work is in every path
alike: the bare calls are the floor.

On a GPU the driver calls themselves take tens of microseconds per allocation (the
side-by-side benchmark, bench_pause_resume.py); this measures the part a tool adds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from torch_mem_saver_lite import _lib

HERE = Path(__file__).resolve().parent
FAKE = HERE.parent / "tests" / "fake_cuda"
BLOCKS = {  # callgrind function -> row label
    "bare_alloc_free_block": "bare driver calls: allocate + free",
    "ours_torch_alloc_free_block": "ours, torch hook: allocate + free",
    "ours_preload_alloc_free_block": "ours, preload hook: allocate + free",
    "tms_torch_alloc_free_block": "torch_memory_saver, torch hook: allocate + free",
    "bare_pause_resume_block": "bare driver calls: pause + resume (no backup)",
    "ours_pause_resume_block": "ours: pause + resume (no backup)",
    "tms_pause_resume_block": "torch_memory_saver: pause + resume (no backup)",
}


def build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    flags = ["-std=c11", "-O2", "-shared", "-fPIC"]
    subprocess.run([cc, *flags, "-Wl,-soname,libcuda.so.1", "-o", out / "libcuda.so.1",
                    FAKE / "fake_libcuda.c"], check=True)
    subprocess.run([cc, *flags, "-Wl,-soname,libcudart.so.12", "-o", out / "libcudart.so.12",
                    FAKE / "fake_libcudart.c", f"-L{out}", "-l:libcuda.so.1"], check=True)
    subprocess.run([cc, "-std=c11", "-O2", "-o", out / "core_overhead", HERE / "support" / "core_overhead.c", "-ldl"],
                   check=True)


def tms_torch_hook(tms_path: str | None) -> str | None:
    """torch_memory_saver's torch-mode library built against CUDA 12's runtime (the fake's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tms_path, os.environ.get("PYTHONPATH")) if p)}
    found = subprocess.run([sys.executable, "-c", "import torch_memory_saver, os; "
                            "print(os.path.dirname(torch_memory_saver.__file__))"],
                           capture_output=True, text=True, env=env)
    if found.returncode != 0:
        return None
    package = Path(found.stdout.strip())
    for directory in (package, package.parent):
        for name in ("torch_memory_saver_hook_mode_torch_cu12*.so", "torch_memory_saver_hook_mode_torch.*so"):
            hits = sorted(directory.glob(name))
            if hits:
                return str(hits[0])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=41, help="blocks per path for the times (median)")
    parser.add_argument("--tms-path", help="a directory holding torch_memory_saver")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        build(out)
        tms = tms_torch_hook(args.tms_path)
        command = [str(out / "core_overhead"), str(out / "libcuda.so.1"), _lib.library_path(),
                   str(args.allocations)]
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [tmp, os.environ.get("LD_LIBRARY_PATH")]))}
        extra = [tms] if tms else []
        print(f"library: {_lib.library_path()}")
        print(f"torch_memory_saver: {tms or 'not installed (ours and the bare calls only)'}")
        subprocess.run([*command, str(args.blocks), *extra], env=env, check=True)
        if shutil.which("valgrind") is None:
            print("valgrind not installed: no instruction counts")
            return 0
        profile = out / "callgrind.out"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={profile}", *command, "3", *extra],
                       env=env, check=True, capture_output=True)
        report = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(profile)],
                                capture_output=True, text=True, check=True).stdout
        counts = {}
        for line in report.splitlines():
            match = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S*?:(\w+_block)", line)
            if match:
                counts[match.group(2)] = int(match.group(1).replace(",", "")) / (3 * args.allocations)
        print(f"\ninstructions per allocation (callgrind, {args.allocations} allocations x 3 blocks):")
        floor = {"alloc": counts.get("bare_alloc_free_block", 0), "cycle": counts.get("bare_pause_resume_block", 0)}
        for name, label in BLOCKS.items():
            if name in counts:
                base = floor["cycle" if "pause" in name else "alloc"]
                added = "" if name.startswith("bare") else f"   adds {counts[name] - base:6.0f} over the bare calls"
                print(f"  {label:50} {counts[name]:7.0f}{added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
