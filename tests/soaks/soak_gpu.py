"""Pause/resume soak on the GPU: many cycles with and without backup, then the process's
host memory, device memory in use, open file descriptors and the saver's allocation table
compared with their values after a warm-up.

    python tests/soaks/soak_gpu.py [--cycles 1000] [--mib 1024]

Exits 1 if anything grew beyond its tolerance (host RSS 64 MiB, device memory 64 MiB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

MiB = 1 << 20


def snapshot(saver, tag: str) -> dict:
    saver.wait_for_released_backups()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    return dict(rss=rss, device_used=total - free, fds=len(os.listdir("/proc/self/fd")),
                allocations=saver.stats()[tag].allocations)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--mib", type=int, default=1024, help="bytes paused per cycle, in MiB")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU available: this soak needs one", file=sys.stderr)
        return 1
    from torch_mem_saver_lite import saver

    grew = False
    print(f"{'variant':10} {'cycles':>6} {'s/cycle':>8} {'host RSS MiB':>18} {'device MiB':>18} "
          f"{'fds':>9} {'allocs':>9}")
    for variant, backup in (("no_backup", False), ("backup", True)):
        tag = f"soak-{variant}"
        with saver.region(tag, enable_cpu_backup=backup):
            tensors = [torch.full((args.mib * MiB // 8,), i, dtype=torch.uint8, device="cuda") for i in range(8)]
        for _ in range(10):
            saver.pause(tag)
            saver.resume(tag)
        start = snapshot(saver, tag)
        began = time.perf_counter()
        for _ in range(args.cycles):
            saver.pause(tag)
            saver.resume(tag)
        seconds = (time.perf_counter() - began) / args.cycles
        end = snapshot(saver, tag)
        content_ok = not backup or all(bool((t == i).all()) for i, t in enumerate(tensors))  # every byte
        grew |= (end["rss"] - start["rss"] > 64 * MiB or end["device_used"] - start["device_used"] > 64 * MiB
                 or end["fds"] != start["fds"] or end["allocations"] != start["allocations"] or not content_ok)
        print(f"{variant:10} {args.cycles:6d} {seconds:8.4f} {start['rss'] / MiB:8.0f} -> {end['rss'] / MiB:6.0f} "
              f"{start['device_used'] / MiB:8.0f} -> {end['device_used'] / MiB:6.0f} "
              f"{start['fds']:4d}->{end['fds']:<4d} {start['allocations']:4d}->{end['allocations']:<4d}"
              f"{'' if content_ok else '  CONTENT LOST'}")
        del tensors
        saver.empty_cache(tag)
    print("growth found" if grew else "no growth")
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
