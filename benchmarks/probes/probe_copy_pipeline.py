"""Where a backed-up pause or resume loses time against the link, in six questions answered on
the GPU machine.

1. one_big resume: creating and mapping 8 GiB, then copying it in, from torch's pinned memory
   or from 64 MiB page-locked ranges (the saver's arena), in one copy or in 64 MiB parts, on
   one stream or two; against the same copy into memory mapped long before.
2. many allocations (many_small: 410 x 20 MiB, weights: 238 of 2-64 MiB): does unmapping and
   releasing one allocation while the copies of the next ones run overlap with them (pause),
   and does mapping the next while copying into the previous (resume)?
3. Is the first write into freshly mapped memory slower than later ones, and does it matter
   whether the address range is new or kept (as a resume keeps it)?
4. Would one_big gain from physical memory in pieces, each released once copied (pause) and
   copied once mapped (resume)?
5. Does the size of the host memory's page-locked ranges (each copy stays inside one) bound
   the copies: 64 MiB ranges (the saver's) against larger ones?
6. Does a resume straight after releasing gigabytes copy slower than one a moment later?

    python benchmarks/probes/probe_copy_pipeline.py [--only one_big,fresh_write,chunked,pipeline,ranges,release_gap]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: support
from support.driver_calls import device_props, ok  # noqa: E402
from support.host_stages import PIECE as RANGE  # noqa: E402
from support.host_stages import FreshMemory, fault_in, in_parallel  # noqa: E402
from support.workloads import tensor_sizes  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def stream() -> cu.CUstream:
    return ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))


def registered_ranges(size: int) -> FreshMemory:
    """Huge-page host memory faulted in on 16 threads, page-locked in 64 MiB ranges (its pieces)."""
    fresh = FreshMemory(size)
    in_parallel(fault_in, fresh.pieces, 16)
    for start, length in fresh.pieces:
        ok(cu.cuMemHostRegister(start, length, 0))
    return fresh


def copy_parts(direction: str, device: int, host: int, size: int, part: int, streams: list) -> None:
    for k, at in enumerate(range(0, size, part)):
        n = min(part, size - at)
        s = streams[k % len(streams)]
        if direction == "h2d":
            ok(cu.cuMemcpyHtoDAsync(device + at, host + at, n, s))
        else:
            ok(cu.cuMemcpyDtoHAsync(host + at, device + at, n, s))


def one_big() -> None:
    size = 8 * GiB
    prop, access = device_props()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    registered = registered_ranges(size)
    ranges = registered.address
    streams = [stream(), stream()]
    va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    print(f"one_big: {size / GiB:.0f} GiB, resume as the saver does it (the reservation kept); median of 3")
    print(f"{'host memory':24} {'copy':14} {'streams':>7} {'map ms':>7} {'copy ms':>8} {'total ms':>8} "
          f"{'copy GB/s':>9} {'total GB/s':>10} {'D2H GB/s':>9}")
    for host_label, host in (("torch pinned", pinned.data_ptr()), ("64 MiB registered", ranges)):
        for copy_label, part in (("one piece", size), ("64 MiB parts", RANGE)):
            if host_label != "torch pinned" and part == size:
                continue  # one copy may not cross registrations
            for n_streams in (1, 2):
                if part == size and n_streams == 2:
                    continue
                maps, copies, totals, d2h = [], [], [], []
                for _ in range(3):
                    ok(cu.cuCtxSynchronize())
                    t0 = time.perf_counter()
                    handle = ok(cu.cuMemCreate(size, prop, 0))
                    ok(cu.cuMemMap(va, size, 0, handle, 0))
                    ok(cu.cuMemSetAccess(va, size, [access], 1))
                    t1 = time.perf_counter()
                    copy_parts("h2d", int(va), host, size, part, streams[:n_streams])
                    ok(cu.cuCtxSynchronize())
                    t2 = time.perf_counter()
                    copy_parts("d2h", int(va), host, size, part, streams[:n_streams])
                    ok(cu.cuCtxSynchronize())
                    t3 = time.perf_counter()
                    ok(cu.cuMemUnmap(va, size))
                    ok(cu.cuMemRelease(handle))
                    maps.append(t1 - t0)
                    copies.append(t2 - t1)
                    totals.append(t2 - t0)
                    d2h.append(t3 - t2)
                m, c, t, d = (statistics.median(x) for x in (maps, copies, totals, d2h))
                print(f"{host_label:24} {copy_label:14} {n_streams:>7} {m * 1e3:7.1f} {c * 1e3:8.1f} {t * 1e3:8.1f} "
                      f"{size / c / 1e9:9.1f} {size / t / 1e9:10.1f} {size / d / 1e9:9.1f}")
    # The link: the same copies into memory mapped long before (touched by the D2H above).
    handle = ok(cu.cuMemCreate(size, prop, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    ok(cu.cuMemSetAccess(va, size, [access], 1))
    for host_label, host, part in (("torch pinned", pinned.data_ptr(), size), ("64 MiB registered", ranges, RANGE)):
        for direction in ("h2d", "d2h", "h2d"):
            ok(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            copy_parts(direction, int(va), host, size, part, streams[:1])
            ok(cu.cuCtxSynchronize())
            seconds = time.perf_counter() - t0
            print(f"  mapped long before, {host_label}, {direction}: {size / seconds / 1e9:.1f} GB/s")
    ok(cu.cuMemUnmap(va, size))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(va, size))
    for start, _ in registered.pieces:
        ok(cu.cuMemHostUnregister(start))
    registered.close()
    del pinned


def fresh_write() -> None:
    """Is the first write into freshly mapped memory slower, and does the address matter?"""
    size = 8 * GiB
    prop, access = device_props()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host = pinned.data_ptr()
    kept = ok(cu.cuMemAddressReserve(size, 0, 0, 0))

    def h2d(va) -> float:
        ok(cu.cuCtxSynchronize())
        t0 = time.perf_counter()
        ok(cu.cuMemcpyHtoD(va, host, size))
        return size / (time.perf_counter() - t0) / 1e9

    print("first write into fresh memory, 8 GiB H2D from torch's pinned memory, GB/s per try:")
    for label in ("new reservation each time", "reservation kept (a resume)", "kept, memset first"):
        first, second, memset_ms = [], [], []
        for _ in range(4):
            va = kept if label.startswith(("reservation kept", "kept")) else ok(cu.cuMemAddressReserve(size, 0, 0, 0))
            handle = ok(cu.cuMemCreate(size, prop, 0))
            ok(cu.cuMemMap(va, size, 0, handle, 0))
            ok(cu.cuMemSetAccess(va, size, [access], 1))
            if label == "kept, memset first":
                ok(cu.cuCtxSynchronize())
                t0 = time.perf_counter()
                ok(cu.cuMemsetD8(va, 0, size))
                ok(cu.cuCtxSynchronize())
                memset_ms.append((time.perf_counter() - t0) * 1e3)
            first.append(h2d(va))
            second.append(h2d(va))
            ok(cu.cuMemUnmap(va, size))
            ok(cu.cuMemRelease(handle))
            if va != kept:
                ok(cu.cuMemAddressFree(va, size))
        extra = f"; memset {', '.join(f'{m:.1f}' for m in memset_ms)} ms" if memset_ms else ""
        print(f"  {label:28}: first write {', '.join(f'{v:.1f}' for v in first)}; "
              f"second {', '.join(f'{v:.1f}' for v in second)}{extra}")
    ok(cu.cuMemAddressFree(kept, size))
    del pinned


def chunked() -> None:
    """one_big mapped from physical pieces: pause (each piece released once copied) and resume
    (each piece copied once mapped) against one 8 GiB piece."""
    size = 8 * GiB
    prop, access = device_props()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host = pinned.data_ptr()
    s = stream()
    reservation = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    va = int(reservation)
    print("one_big from physical pieces, median of 3 (pause: each piece released once copied; "
          "resume: each piece copied once mapped)")
    for piece in (size, GiB, 256 * MiB, 64 * MiB):
        offsets = range(0, size, piece)
        events = {at: ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)) for at in offsets}
        handles: dict[int, cu.CUmemGenericAllocationHandle] = {}
        resumes, pauses = [], []
        for _ in range(4):
            ok(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            for at in offsets:
                handles[at] = ok(cu.cuMemCreate(piece, prop, 0))
                ok(cu.cuMemMap(va + at, piece, 0, handles[at], 0))
                ok(cu.cuMemSetAccess(va + at, piece, [access], 1))
                ok(cu.cuMemcpyHtoDAsync(va + at, host + at, piece, s))
            ok(cu.cuCtxSynchronize())
            t1 = time.perf_counter()
            for at in offsets:
                ok(cu.cuMemcpyDtoHAsync(host + at, va + at, piece, s))
                ok(cu.cuEventRecord(events[at], s))
            for at in offsets:
                ok(cu.cuEventSynchronize(events[at]))
                ok(cu.cuMemUnmap(va + at, piece))
                ok(cu.cuMemRelease(handles[at]))
            t2 = time.perf_counter()
            resumes.append(t1 - t0)
            pauses.append(t2 - t1)
        r, p = statistics.median(resumes[1:]), statistics.median(pauses[1:])
        print(f"  pieces of {piece / MiB:6.0f} MiB: resume {r * 1e3:6.1f} ms = {size / r / 1e9:5.1f} GB/s; "
              f"pause {p * 1e3:6.1f} ms = {size / p / 1e9:5.1f} GB/s")
        for event in events.values():
            ok(cu.cuEventDestroy(event))
    ok(cu.cuMemAddressFree(reservation, size))
    del pinned


def ranges() -> None:
    """8 GiB copied range by range between memory mapped long before and host memory
    page-locked in ranges of one size, one copy per range; then a resume as the saver does it
    (256 MiB device pieces, each copied once mapped) from those ranges."""
    size = 8 * GiB
    prop, access = device_props()
    fresh = FreshMemory(size)
    in_parallel(fault_in, fresh.pieces, 16)
    host = fresh.address
    s = stream()
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    handle = ok(cu.cuMemCreate(size, prop, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    ok(cu.cuMemSetAccess(va, size, [access], 1))
    print("8 GiB by page-locked range size, one copy per range, median of 3 (GB/s):")
    for range_bytes in (64 * MiB, 256 * MiB, GiB, size):
        starts = range(0, size, range_bytes)
        for at in starts:
            ok(cu.cuMemHostRegister(host + at, range_bytes, 0))
        speeds = {}
        for direction in ("h2d", "d2h"):
            runs = []
            for _ in range(3):
                ok(cu.cuCtxSynchronize())
                t0 = time.perf_counter()
                copy_parts(direction, va, host, size, range_bytes, [s])
                ok(cu.cuCtxSynchronize())
                runs.append(size / (time.perf_counter() - t0) / 1e9)
            speeds[direction] = statistics.median(runs)
        ok(cu.cuMemUnmap(va, size))
        ok(cu.cuMemRelease(handle))
        piece = 256 * MiB
        resumes, handles = [], {}
        for _ in range(3):
            ok(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            for at in range(0, size, piece):
                handles[at] = ok(cu.cuMemCreate(piece, prop, 0))
                ok(cu.cuMemMap(va + at, piece, 0, handles[at], 0))
                ok(cu.cuMemSetAccess(va + at, piece, [access], 1))
                for part in range(at, at + piece, min(piece, range_bytes)):
                    ok(cu.cuMemcpyHtoDAsync(va + part, host + part, min(piece, range_bytes), s))
            ok(cu.cuCtxSynchronize())
            resumes.append(size / (time.perf_counter() - t0) / 1e9)
            for at, h in handles.items():
                ok(cu.cuMemUnmap(va + at, piece))
                ok(cu.cuMemRelease(h))
        handle = ok(cu.cuMemCreate(size, prop, 0))
        ok(cu.cuMemMap(va, size, 0, handle, 0))
        ok(cu.cuMemSetAccess(va, size, [access], 1))
        for at in starts:
            ok(cu.cuMemHostUnregister(host + at))
        print(f"  ranges of {range_bytes / MiB:5.0f} MiB: H2D {speeds['h2d']:5.1f}  D2H {speeds['d2h']:5.1f}  "
              f"resume in 256 MiB pieces {statistics.median(resumes):5.1f}")
    ok(cu.cuMemUnmap(va, size))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(va, size))
    fresh.close()


def release_gap() -> None:
    """8 GiB resumed as the saver does it (256 MiB pieces, each copied once mapped), released
    again at once, then idle for `gap` seconds before the next: five tries per gap."""
    size, piece = 8 * GiB, 256 * MiB
    prop, access = device_props()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host = pinned.data_ptr()
    s = stream()
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))

    def resume_then_release() -> float:
        ok(cu.cuCtxSynchronize())
        t0 = time.perf_counter()
        handles = {}
        for at in range(0, size, piece):
            handles[at] = ok(cu.cuMemCreate(piece, prop, 0))
            ok(cu.cuMemMap(va + at, piece, 0, handles[at], 0))
            ok(cu.cuMemSetAccess(va + at, piece, [access], 1))
            ok(cu.cuMemcpyHtoDAsync(va + at, host + at, piece, s))
        ok(cu.cuCtxSynchronize())
        gbps = size / (time.perf_counter() - t0) / 1e9
        for at, handle in handles.items():
            ok(cu.cuMemUnmap(va + at, piece))
            ok(cu.cuMemRelease(handle))
        return gbps

    print("resume of 8 GiB in 256 MiB pieces, by idle time after the last release (GB/s per try):")
    for gap in (0.0, 0.1, 0.3, 1.0):
        speeds = []
        for _ in range(5):
            speeds.append(resume_then_release())
            time.sleep(gap)
        print(f"  idle {gap:3.1f} s: {' '.join(f'{v:5.1f}' for v in speeds)}")
    ok(cu.cuMemAddressFree(va, size))
    del pinned


def pipelined_workload(workload: str, sizes: list[int], host: int) -> None:
    """Sequential against pipelined pause and resume of `sizes`, each its own reservation."""
    prop, access = device_props()
    s = stream()
    vas = [ok(cu.cuMemAddressReserve(n, 0, 0, 0)) for n in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    nbytes = sum(sizes)
    events = [ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)) for _ in sizes]
    order = range(len(sizes))

    def map_one(i: int) -> cu.CUmemGenericAllocationHandle:
        h = ok(cu.cuMemCreate(sizes[i], prop, 0))
        ok(cu.cuMemMap(vas[i], sizes[i], 0, h, 0))
        ok(cu.cuMemSetAccess(vas[i], sizes[i], [access], 1))
        return h

    def release_one(i: int) -> None:
        ok(cu.cuMemUnmap(vas[i], sizes[i]))
        ok(cu.cuMemRelease(handles[i]))

    def d2h(i: int) -> None:
        ok(cu.cuMemcpyDtoHAsync(host + offsets[i], vas[i], sizes[i], s))

    def h2d(i: int) -> None:
        ok(cu.cuMemcpyHtoDAsync(vas[i], host + offsets[i], sizes[i], s))

    def pause_sequential() -> None:  # what the saver did: copy everything, then release
        for i in order:
            d2h(i)
        ok(cu.cuStreamSynchronize(s))
        for i in order:
            release_one(i)

    def resume_sequential() -> None:
        for i in order:
            handles[i] = map_one(i)
        for i in order:
            h2d(i)

    def pause_pipelined() -> None:  # every copy queued with an event; each released once copied
        for i in order:
            d2h(i)
            ok(cu.cuEventRecord(events[i], s))
        for i in order:
            ok(cu.cuEventSynchronize(events[i]))
            release_one(i)

    def resume_pipelined() -> None:  # each copy queued once mapped: the next maps meanwhile
        for i in order:
            handles[i] = map_one(i)
            h2d(i)

    def copies_out() -> None:
        for i in order:
            d2h(i)

    def copies_in() -> None:
        for i in order:
            h2d(i)

    def release_and_map() -> None:
        for i in order:
            release_one(i)
        for i in order:
            handles[i] = map_one(i)

    handles = [map_one(i) for i in order]
    results: dict[str, list[float]] = {}
    steps = (("pause: copy all, then release all", pause_sequential),
             ("resume: map all, then copy all", resume_sequential),
             ("pause: release each once copied", pause_pipelined),
             ("resume: copy each once mapped", resume_pipelined),
             ("copies alone (D2H)", copies_out), ("copies alone (H2D)", copies_in),
             ("unmap+release all, then map all (no copies)", release_and_map))
    for _ in range(3):
        for label, step in steps:
            ok(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            step()
            ok(cu.cuCtxSynchronize())
            results.setdefault(label, []).append(time.perf_counter() - t0)
    print(f"{workload}: {len(sizes)} allocations, {nbytes / GiB:.2f} GiB (median of 3)")
    for label, values in results.items():
        seconds = statistics.median(values)
        print(f"  {label:46s} {seconds * 1e3:8.1f} ms {nbytes / seconds / 1e9:6.1f} GB/s")
    for i in order:
        release_one(i)
        ok(cu.cuMemAddressFree(vas[i], sizes[i]))
        ok(cu.cuEventDestroy(events[i]))


def pipeline() -> None:
    workloads = {"many_small": [20 * MiB] * 410,
                 "weights": [-(-n // (2 * MiB)) * 2 * MiB for n in tensor_sizes("weights", 8 * GiB)]}
    pinned = torch.empty(max(sum(sizes) for sizes in workloads.values()), dtype=torch.uint8, pin_memory=True)
    for workload, sizes in workloads.items():
        pipelined_workload(workload, sizes, pinned.data_ptr())
    del pinned


SECTIONS = {"one_big": one_big, "fresh_write": fresh_write, "chunked": chunked, "pipeline": pipeline,
            "ranges": ranges, "release_gap": release_gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS))
    args = parser.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")  # torch's context, current on this thread
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.only.split(","):
        SECTIONS[name]()


if __name__ == "__main__":
    main()
