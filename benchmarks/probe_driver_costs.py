"""Two questions about the driver, answered on the GPU machine:

1. Do several threads speed up creating/mapping many 2 MiB allocations, and how fast do
   4096 x 2 MiB saver allocations (no backup) pause and resume?
2. How much device memory does page-locking host memory (cuMemHostRegister) take?

    python benchmarks/probe_driver_costs.py
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import torch
from cuda.bindings import driver as cu

from torch_mem_saver_lite import saver

MiB, GiB = 1 << 20, 1 << 30


def threaded_mallocs(native, count: int, threads: int, tag: str) -> tuple[float, list[int]]:
    ptrs: list[int] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        mine = [native.malloc(2 * MiB, 0, tag, False) for _ in range(n)]
        with lock:
            ptrs.extend(mine)

    workers = [threading.Thread(target=work, args=(count // threads,)) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start, ptrs


def main() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    native = saver._core()
    print("4096 x 2 MiB saver allocations (8 GiB), no backup:")
    for threads in (1, 4, 8, 16):
        tag = f"probe-{threads}"
        seconds, ptrs = threaded_mallocs(native, 4096, threads, tag)
        t0 = time.perf_counter()
        native.pause([tag])
        t1 = time.perf_counter()
        native.resume([tag])
        t2 = time.perf_counter()
        print(f"  malloc on {threads:2d} threads: {seconds * 1e3 / 8:6.2f} ms/GiB | pause {(t1 - t0) * 1e3 / 8:5.2f} "
              f"ms/GiB, resume {(t2 - t1) * 1e3 / 8:5.2f} ms/GiB (single-threaded core)")
        for p in ptrs:
            native.free(p)

    print("device memory taken by page-locking 8 GiB of host memory:")
    for advice in ("4 KiB pages", "huge pages (madvise)"):
        buf = mmap.mmap(-1, 8 * GiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if advice.startswith("huge"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        for offset in range(0, 8 * GiB, 4096):
            buf[offset] = 0
        torch.cuda.synchronize()
        free0 = cu.cuMemGetInfo()[1]
        assert cu.cuMemHostRegister(address, 8 * GiB, cu.CU_MEMHOSTREGISTER_PORTABLE)[0] == cu.CUresult.CUDA_SUCCESS
        free1 = cu.cuMemGetInfo()[1]
        cu.cuMemHostUnregister(address)
        with open("/proc/meminfo") as meminfo:
            huge = next(line.split()[1] for line in meminfo if line.startswith("AnonHugePages"))
        print(f"  {advice:22s}: {(free0 - free1) / MiB:6.1f} MiB of device memory "
              f"({(free0 - free1) / (8 * GiB):.2%}); AnonHugePages {int(huge) // 1024} MiB")
        del address
        buf.close()


if __name__ == "__main__":
    main()
