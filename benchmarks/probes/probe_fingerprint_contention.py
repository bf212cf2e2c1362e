"""Does fingerprinting a backup before copying it leave the link idle while several processes
pause at once, and does fingerprinting beside the copy slow the copy?

--processes processes
each hold --gib GiB on one GPU; at one start, each copies its bytes to page-locked host memory
alone, or fingerprints them first (the library's kernel, as a pause of a shared backup did),
or fingerprints them while the copy runs (the kernel on its own stream, as a pause that copies
while it fingerprints does). Per variant: when the last fingerprint ended and when the last
copy ended, from the common start.

    python benchmarks/probes/probe_fingerprint_contention.py [--processes 4] [--gib 8] [--repeats 3]

Needs the testing ABI (an editable install: make install).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WORKER = r"""
import ctypes, json, sys, time
import torch
from torch_mem_saver_lite import _lib, saver
gib, repeats, variant = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
n = int(gib * (1 << 30))
data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
lanes = (ctypes.c_uint64 * 4)()
def fingerprint():
    _lib.check(_lib.lib().tmsl_fingerprint_memory(saver._core().handle, 0, data.data_ptr(), n, 1, lanes))
_lib.lib().tmsl_fingerprint_memory(saver._core().handle, 0, data.data_ptr(), 1 << 20, 1, lanes)  # loaded
torch.cuda.synchronize()
for _ in range(repeats):
    print("ready", flush=True)
    start = float(sys.stdin.readline())  # a moment of time.time() shortly ahead: the common start
    while time.time() < start:
        pass
    if variant == "before":
        fingerprint()
    printed = time.time()
    host.copy_(data, non_blocking=True)
    if variant == "beside":
        fingerprint()
        printed = time.time()
    torch.cuda.synchronize()
    print(json.dumps([printed - start, time.time() - start]), flush=True)
"""


def run(processes: int, gib: float, repeats: int, variant: str) -> list[tuple[float, float]]:
    children = [subprocess.Popen([sys.executable, "-c", WORKER, str(gib), str(repeats), variant],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    rows = []
    for _ in range(repeats):
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        start = time.time() + 0.2
        for child in children:
            child.stdin.write(f"{start}\n")
            child.stdin.flush()
        ends = [json.loads(child.stdout.readline()) for child in children]
        rows.append((max(e[0] for e in ends), max(e[1] for e in ends)))
    for child in children:
        child.stdin.close()
        child.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.processes} processes x {args.gib:g} GiB, {args.repeats} repeats (median)")
    print("| variant | last fingerprint ended (ms) | last copy ended (ms) |")
    print("| --- | --- | --- |")
    names = {"alone": "copy alone", "before": "fingerprint, then copy", "beside": "copy, fingerprinted beside it"}
    for variant, name in names.items():
        rows = run(args.processes, args.gib, args.repeats, variant)
        fp = statistics.median(r[0] for r in rows) * 1e3
        copy = statistics.median(r[1] for r in rows) * 1e3
        print(f"| {name} | {fp:.1f} | {copy:.1f} |")


if __name__ == "__main__":
    main()
