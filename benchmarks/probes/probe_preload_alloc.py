"""Why allocating inside a region costs more in one process than another: the bare driver
calls of an allocation, timed before and after the tool's own allocations in the same process.

    python benchmarks/probes/probe_preload_alloc.py {ours,tms} {torch,preload}   (preload: start it
    with the tool's library in LD_PRELOAD)

Prints, median of 3: 410 x 20 MiB reserve+create+map+access and unmap+release+free through
cuda-python; 4096 x 2 MiB tensors allocated in a fresh region (the benchmark's many_small);
and, in preload mode, 410 x cudaMalloc(20 MiB) called straight through the preloaded symbol.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: support
from support.driver_calls import device_props, ok  # noqa: E402

MiB = 1 << 20
COUNT, SIZE = 410, 20 * MiB


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.1f} ms"


def bare_driver(label: str) -> None:
    prop, access = device_props()
    maps, unmaps = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        entries = []
        for _ in range(COUNT):
            va = ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0))
            h = ok(cu.cuMemCreate(SIZE, prop, 0))
            ok(cu.cuMemMap(va, SIZE, 0, h, 0))
            ok(cu.cuMemSetAccess(va, SIZE, [access], 1))
            entries.append((va, h))
        t1 = time.perf_counter()
        for va, h in entries:
            ok(cu.cuMemUnmap(va, SIZE))
            ok(cu.cuMemRelease(h))
            ok(cu.cuMemAddressFree(va, SIZE))
        unmaps.append(time.perf_counter() - t1)
        maps.append(t1 - t0)
    print(f"  bare driver {label:8}: reserve+create+map+access {median_ms(maps)}, "
          f"unmap+release+free {median_ms(unmaps)}")


def main() -> None:
    tool, mode = sys.argv[1], sys.argv[2]
    torch.empty(1, device="cuda")
    if tool == "ours":
        from torch_mem_saver_lite import saver
    else:
        from torch_memory_saver import torch_memory_saver as saver
    saver.hook_mode = mode
    print(f"{tool}, {mode} mode, LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    bare_driver("before")
    region_ms = []
    keep = []
    for i in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with saver.region(f"probe-{i}") if tool == "ours" else saver.region(tag=f"probe-{i}"):
            keep.append([torch.empty(2 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4096)])
        torch.cuda.synchronize()
        region_ms.append(time.perf_counter() - t0)
    print(f"  4096 x 2 MiB tensors in a fresh region: {median_ms(region_ms)} "
          f"({', '.join(f'{v * 1e3:.1f}' for v in region_ms)})")
    if mode == "preload":
        malloc = ctypes.CDLL(None).cudaMalloc  # the preloaded definition comes first
        malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        times = []
        for i in range(3):
            ptrs = []
            with saver.region(f"probe-raw-{i}") if tool == "ours" else saver.region(tag=f"probe-raw-{i}"):
                t0 = time.perf_counter()
                for _ in range(COUNT):
                    p = ctypes.c_void_p()
                    assert malloc(ctypes.byref(p), SIZE) == 0
                    ptrs.append(p)
                times.append(time.perf_counter() - t0)
            keep.append(ptrs)  # left allocated: freeing outside the region differs between the tools
        print(f"  {COUNT} x cudaMalloc(20 MiB) through the preloaded symbol, in a region: {median_ms(times)}")
    bare_driver("after")


if __name__ == "__main__":
    main()
