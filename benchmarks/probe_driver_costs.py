"""Two questions about the driver, answered on the GPU machine:

1. Do several threads speed up creating/mapping many 2 MiB allocations, and how fast do
   4096 x 2 MiB saver allocations (no backup) pause and resume?
2. How much device memory does page-locking host memory (cuMemHostRegister) take?
3. How fast is page-locking pre-faulted memory in one call, in 64 MiB pieces, and in 64 MiB
   pieces on 16 threads; and can one CUDA copy cross from one registration into the next?

    python benchmarks/probe_driver_costs.py [--only allocations,footprint,pinning]
"""

from __future__ import annotations

import argparse
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


def host_buffer(size: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory with huge pages advised, faulted in by 16 threads (ctypes.memset
    releases the GIL)."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    piece = size // 16
    workers = [threading.Thread(target=ctypes.memset, args=(address + i * piece, 1, piece)) for i in range(16)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return buf, address


def pinning_speed() -> None:
    libcuda = ctypes.CDLL("libcuda.so.1")  # ctypes calls release the GIL: threads really run in parallel
    register, unregister = libcuda.cuMemHostRegister_v2, libcuda.cuMemHostUnregister
    register.argtypes, unregister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], [ctypes.c_void_p]
    context = ctypes.c_void_p()
    assert libcuda.cuCtxGetCurrent(ctypes.byref(context)) == 0 and context.value  # torch made it current
    size, piece = 8 * GiB, 64 * MiB
    buf, address = host_buffer(size)
    print("page-locking 8 GiB of faulted-in huge-page memory:")

    def timed(label: str, ranges: list[tuple[int, int]], threads: int) -> None:
        def work(part: list[tuple[int, int]]) -> None:
            assert libcuda.cuCtxSetCurrent(context) == 0
            for start, length in part:
                assert register(start, length, 0) == 0

        parts = [ranges[t::threads] for t in range(threads)]
        workers = [threading.Thread(target=work, args=(part,)) for part in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        for start, _ in ranges:
            unregister(start)
        print(f"  {label:34s}: {seconds * 1e3:7.1f} ms = {size / seconds / 1e9:6.1f} GB/s")

    pieces = [(address + o, piece) for o in range(0, size, piece)]
    timed("one call", [(address, size)], 1)
    timed("128 x 64 MiB, one thread", pieces, 1)
    timed("128 x 64 MiB, 16 threads", pieces, 16)
    timed("one call again", [(address, size)], 1)

    print("one CUDA copy across two adjacent registrations:")
    for label, ranges in (("one registration", [(address, 2 * piece)]),
                          ("two registrations", [(address, piece), (address + piece, piece)])):
        for start, length in ranges:
            assert register(start, length, 0) == 0
        host = torch.frombuffer(buf, dtype=torch.uint8, count=2 * piece)
        try:
            torch.empty(2 * piece, dtype=torch.uint8, device="cuda").copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            outcome = "works"
        except Exception as error:  # noqa: BLE001 - the probe reports whatever the driver says
            outcome = f"fails: {str(error).splitlines()[0]}"
        for start, _ in ranges:
            unregister(start)
        print(f"  {label:18s}: {outcome}")
    del host
    buf.close()


def allocations() -> None:
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


def footprint() -> None:
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


SECTIONS = {"allocations": allocations, "footprint": footprint, "pinning": pinning_speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS))
    names = parser.parse_args().only.split(",")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    for name in names:
        SECTIONS[name]()


if __name__ == "__main__":
    main()
