"""What the driver's calls cost where a saver makes many of them, in five questions answered on
the GPU machine: many small allocations, page-locking host memory, a first pause's host memory,
and a pause and resume without backup against the bare driver calls they make.

1. Do several threads speed up creating/mapping many 2 MiB allocations, and how fast do
   4096 x 2 MiB saver allocations (no backup) pause and resume?
2. How much device memory does page-locking host memory (cuMemHostRegister) take?
3. How fast is page-locking pre-faulted memory in one call, in 64 MiB pieces, and in 64 MiB
   pieces on 16 threads; and can one CUDA copy cross from one registration into the next?
4. The stages of a first pause's host memory, each alone and faulting-in under a running copy.
5. Pause/resume without backup against the bare driver calls it makes (same sizes).

    python benchmarks/probes/probe_driver_costs.py [--only allocations,footprint,pinning,stages,no_copy]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import mmap
import os
import pstats
import sys
import threading
import time

import torch
from cuda.bindings import driver as cu

from torch_mem_saver_lite import saver

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: support

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


def stages() -> None:
    """Each stage of preparing 8 GiB of host memory for a first pause, alone, at its own speed."""
    from support.host_stages import FreshMemory, fault_in, in_parallel, page_locker

    size = 8 * GiB
    lock, unlock_all = page_locker()
    for path in ("enabled", "defrag"):
        with open(f"/sys/kernel/mm/transparent_hugepage/{path}") as f:
            print(f"THP {path}: {f.read().strip()}")
    print(f"cores: {len(os.sched_getaffinity(0))}")

    def rate(seconds: float) -> str:
        return f"{seconds * 1e3:7.1f} ms = {size / seconds / 1e9:6.1f} GB/s"

    print("8 GiB of fresh huge-page memory, in 64 MiB pieces:")
    for threads in (1, 4, 8, 15, 16):
        fresh = FreshMemory(size)
        seconds = in_parallel(fault_in, fresh.pieces, threads)
        print(f"  fault in (memset), {threads:2d} threads          : {rate(seconds)}")
        if threads == 16:
            for lockers in (1, 16):
                seconds = in_parallel(lock, fresh.pieces, lockers)
                print(f"  page-lock the faulted pieces, {lockers:2d} threads: {rate(seconds)}")
                unlock_all(fresh.pieces)
        fresh.close()
    fresh = FreshMemory(size)
    print(f"  page-lock unfaulted pieces, 16 threads   : {rate(in_parallel(lock, fresh.pieces, 16))}")
    unlock_all(fresh.pieces)
    fresh.close()
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pinned.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    print(f"  D2H copy into pinned memory, alone       : {rate(time.perf_counter() - t0)}")
    fresh = FreshMemory(size)
    t0 = time.perf_counter()
    pinned.copy_(device, non_blocking=True)
    touched = in_parallel(fault_in, fresh.pieces, 16)
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    print(f"  fault in on 16 threads during that copy  : {rate(touched)}; both done after {both * 1e3:.1f} ms")
    fresh.close()


def no_copy() -> None:
    """Pause/resume without backup: the saver against the bare driver calls on the same sizes."""
    from support.driver_calls import device_props, ok
    from support.workloads import tensor_sizes

    prop, access = device_props()
    repeats = 10
    for workload in ("one_big", "weights", "many_small"):
        sizes = tensor_sizes(workload, 8 * GiB)
        tag = f"nocopy-{workload}"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with saver.region(tag):
            tensors = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
        torch.cuda.synchronize()
        timings: dict[str, list[float]] = {"saver: first allocation": [time.perf_counter() - t0]}
        native = saver._core()
        allocations = native.stats()[tag]["allocations"]
        timings.update({k: [] for k in ("saver.pause", "saver.resume", "core pause", "core resume", "sync")})
        for _ in range(repeats):
            t0 = time.perf_counter(); saver.pause(tag); t1 = time.perf_counter(); saver.resume(tag)  # noqa: E702
            t2 = time.perf_counter(); native.pause([tag]); t3 = time.perf_counter(); native.resume([tag])  # noqa: E702
            t4 = time.perf_counter(); torch.cuda.synchronize(); t5 = time.perf_counter()  # noqa: E702
            for key, value in zip(list(timings)[1:], (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                value and timings[key].append(value)
        # The same number of allocations of the same sizes through the driver alone.
        granule = 2 * MiB
        raw_sizes = [size for _, size, _ in native.allocations(tag)]
        for run, alignment in enumerate((0, granule, 0, granule)):  # both orders: the first run pays warm-up
            t0 = time.perf_counter()
            vas = [ok(cu.cuMemAddressReserve(s, alignment, 0, 0)) for s in raw_sizes]
            handles = [ok(cu.cuMemCreate(s, prop, 0)) for s in raw_sizes]
            for va, s, h in zip(vas, raw_sizes, handles, strict=True):
                ok(cu.cuMemMap(va, s, 0, h, 0)); ok(cu.cuMemSetAccess(va, s, [access], 1))  # noqa: E702
            first = time.perf_counter() - t0
            aligned = min(int(va) & -int(va) for va in vas)
            raw_unmap, raw_map = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ok(cu.cuCtxSynchronize())
                for va, s, h in zip(vas, raw_sizes, handles, strict=True):
                    ok(cu.cuMemUnmap(va, s)); ok(cu.cuMemRelease(h))  # noqa: E702
                t1 = time.perf_counter()
                handles = [ok(cu.cuMemCreate(s, prop, 0)) for s in raw_sizes]
                for va, s, h in zip(vas, raw_sizes, handles, strict=True):
                    ok(cu.cuMemMap(va, s, 0, h, 0)); ok(cu.cuMemSetAccess(va, s, [access], 1))  # noqa: E702
                t2 = time.perf_counter()
                raw_unmap.append(t1 - t0)
                raw_map.append(t2 - t1)
            for va, s, h in zip(vas, raw_sizes, handles, strict=True):
                ok(cu.cuMemUnmap(va, s)); ok(cu.cuMemRelease(h)); ok(cu.cuMemAddressFree(va, s))  # noqa: E702
            label = f"#{run} align {alignment >> 20} MiB" if alignment else f"#{run} align 0 (got {aligned >> 20} MiB)"
            timings[f"driver {label}: reserve+map"] = [first]
            timings[f"driver {label}: unmap+rel"] = raw_unmap
            timings[f"driver {label}: map"] = raw_map
        print(f"{workload}: {len(sizes)} tensors, {allocations} saver allocations, {len(raw_sizes)} driver ones "
              f"(median / min of {repeats}, ms)")
        for key, values in timings.items():
            values = sorted(values)
            print(f"  {key:40s} {values[len(values) // 2] * 1e3:8.2f} {values[0] * 1e3:8.2f}")
        if workload == "one_big":  # where the Python around the core call shows most
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(repeats):
                saver.pause(tag)
                saver.resume(tag)
            profile.disable()
            print(f"  profile of {repeats} saver.pause + saver.resume, by own time:")
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)
        del tensors
        saver.empty_cache(tag)


SECTIONS = {"allocations": allocations, "footprint": footprint, "pinning": pinning_speed, "stages": stages,
            "no_copy": no_copy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--hook-mode", default="torch", help="preload: run under LD_PRELOAD of the saver's library")
    args = parser.parse_args()
    names = args.only.split(",")
    saver.hook_mode = args.hook_mode
    torch.cuda.init()
    torch.empty(1, device="cuda")
    for name in names:
        SECTIONS[name]()


if __name__ == "__main__":
    main()
