"""Does page-locked host memory already in the process slow a first allocation of 4096 x 2 MiB
inside a region (and its pause without backup)? Each variant in a fresh process, --gib GiB of:

  none         nothing page-locked
  shm64        memfd files of 64 MiB (4 KiB pages where shmem has no huge pages), each mapped,
               written and page-locked on its own: as the node's store holds shared backups
  shm64-unreg  the same files mapped and written, not page-locked
  anon         anonymous memory (huge pages where THP allows), page-locked in one registration
  anon64       the same memory page-locked in registrations of 64 MiB each: as a private
               backup's host memory is (HostArena::kRangeBytes), what tells the number of
               registrations from the kind of pages

    python benchmarks/probes/probe_registered_alloc.py [--gib 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import subprocess
import sys
import time

GiB, MiB = 1 << 30, 1 << 20

def child(variant: str, gib: int) -> None:
    import torch

    from torch_mem_saver_lite import saver

    torch.cuda.init()
    torch.empty(1, device="cuda")
    rt = torch.cuda.cudart()
    keep = []
    t0 = time.perf_counter()
    if variant.startswith("shm64"):
        for i in range(gib * GiB // (64 * MiB)):
            fd = os.memfd_create(f"c{i}")
            os.ftruncate(fd, 64 * MiB)
            m = mmap.mmap(fd, 64 * MiB)
            buf = (ctypes.c_char * (64 * MiB)).from_buffer(m)
            ctypes.memset(buf, 1, 64 * MiB)
            if variant == "shm64":
                assert int(rt.cudaHostRegister(ctypes.addressof(buf), 64 * MiB, 0)) == 0
            keep.append((m, buf))
    elif variant in ("anon", "anon64"):
        m = mmap.mmap(-1, gib * GiB)
        buf = (ctypes.c_char * (gib * GiB)).from_buffer(m)
        ctypes.memset(buf, 1, gib * GiB)
        piece = gib * GiB if variant == "anon" else 64 * MiB
        for at in range(0, gib * GiB, piece):
            assert int(rt.cudaHostRegister(ctypes.addressof(buf) + at, piece, 0)) == 0
        keep.append((m, buf))
    setup = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with saver.region("probe"):
        xs = [torch.empty(2 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4096)]
    torch.cuda.synchronize()
    alloc = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    saver.pause("probe")
    pause = (time.perf_counter() - t0) * 1e3
    saver.resume("probe")
    del xs
    print(f"{variant:12s} {gib:3d} GiB  setup {setup:6.2f} s  first alloc {alloc:7.1f} ms  pause {pause:6.1f} ms",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=16, help="host memory per variant (GiB)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the variants")
    parser.add_argument("--variants", default="none,shm64,shm64-unreg,anon,anon64")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "GIB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    for _ in range(args.repeats):
        for variant in args.variants.split(","):
            gib = 0 if variant == "none" else args.gib
            r = subprocess.run([sys.executable, __file__, "--child", variant, str(gib)], capture_output=True, text=True)
            print(r.stdout.strip() or r.stderr[-800:], flush=True)


if __name__ == "__main__":
    main()
