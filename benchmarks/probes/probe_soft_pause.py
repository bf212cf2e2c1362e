"""What a soft pause (`soft_pause`) can be built from, on the GPU machine: the pause's host
copy made of CUDA-VMM host memory (HOST_NUMA), mapped at the paused tensor's own address once
its device memory is released.

1. Creating host handles: granularity, and how fast cuMemCreate makes 256 MiB handles, on one
   thread and on four at once.
2. Can the CPU read and write such a handle through a mapping of its own (access granted to
   the host NUMA node)? Run in a child process, so a fault ends only the child.
3. Copies between device memory and a VMM host handle (through a second mapping, "shadow"),
   against page-locked torch memory: GB/s both ways.
4. The pause, piece by piece: an 8 GiB allocation of 32 device pieces of 256 MiB, copied into
   32 host handles; as each piece's copy lands, its device memory is unmapped and released and
   the host handle mapped at its address (one access change per piece). Total against the
   copies alone: does the remapping hide behind the copies?
5. A kernel reading and writing the soft-paused 8 GiB: right bytes, how fast.
6. The resume, piece by piece: the host mapping at the address taken down, device memory
   created and mapped, the copy from the shadow mapping. Total against the copies alone; the
   bytes written while paused are there afterwards.

    python benchmarks/probes/probe_soft_pause.py
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: support
from support.driver_calls import device_props, ok  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PIECE = 256 * MiB


class Raw:
    """A torch view of raw device-visible memory (zero copy)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def view(ptr: int, size: int) -> torch.Tensor:
    return torch.as_tensor(Raw(ptr, size), device="cuda")


def host_prop(numa: int = 0):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = numa
    return prop


def host_access(numa: int = 0):
    a = cu.CUmemAccessDesc()
    a.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    a.location.id = numa
    a.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return a


def ms(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


def creation() -> None:
    flags = cu.CUmemAllocationGranularity_flags
    g_min = ok(cu.cuMemGetAllocationGranularity(host_prop(), flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    g_rec = ok(cu.cuMemGetAllocationGranularity(host_prop(), flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    print(f"1. host granularity: minimum {g_min} B, recommended {g_rec} B", flush=True)
    for threads in (1, 4):
        handles: list = []
        lock = threading.Lock()
        ctx = ok(cu.cuCtxGetCurrent())

        def make(n: int, ctx=ctx, lock=lock, handles=handles) -> None:
            ok(cu.cuCtxSetCurrent(ctx))
            for _ in range(n):
                h = ok(cu.cuMemCreate(PIECE, host_prop(), 0))
                with lock:
                    handles.append(h)

        t = time.perf_counter()
        workers = [threading.Thread(target=make, args=(16 // threads,)) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        took = ms(t)
        print(f"   create 16 x 256 MiB host handles on {threads} thread(s): {took:.1f} ms = "
              f"{4 * GiB / took / 1e6:.1f} GB/s", flush=True)
        t = time.perf_counter()
        for h in handles:
            ok(cu.cuMemRelease(h))
        print(f"   release them: {ms(t):.1f} ms", flush=True)


def cpu_access_child() -> None:
    torch.zeros(1, device="cuda")
    _, dev_access = device_props()
    size = 64 * MiB
    h = ok(cu.cuMemCreate(size, host_prop(), 0))
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    ok(cu.cuMemMap(va, size, 0, h, 0))
    r = cu.cuMemSetAccess(va, size, [dev_access, host_access()], 2)
    print(f"   set access (device + host numa): {r[0].name}", flush=True)
    ctypes.memset(va, 0x5A, size)
    buf = (ctypes.c_ubyte * 16).from_address(va + size - 16)
    print(f"   CPU wrote and read back: {bytes(buf)[:4].hex()}", flush=True)
    v = view(va, size)
    print(f"   GPU sees the CPU's bytes: {bool((v == 0x5A).all().item())}", flush=True)
    v.fill_(0x33)
    torch.cuda.synchronize()
    print(f"   CPU sees the GPU's bytes: {bytes(buf)[:4].hex()}", flush=True)


def copy_speeds() -> None:
    size = 4 * GiB
    _, dev_access = device_props()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda").fill_(7)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    hs = [ok(cu.cuMemCreate(PIECE, host_prop(), 0)) for _ in range(size // PIECE)]
    shadow = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    for k, h in enumerate(hs):
        ok(cu.cuMemMap(shadow + k * PIECE, PIECE, 0, h, 0))
    ok(cu.cuMemSetAccess(shadow, size, [dev_access, host_access()], 2))
    host_view = view(shadow, size)
    for rep in range(2):
        for name, dst in (("pinned torch", pinned), ("VMM host", host_view)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            d2h = ms(t)
            t = time.perf_counter()
            dev.copy_(dst, non_blocking=True)
            torch.cuda.synchronize()
            h2d = ms(t)
            print(f"3. rep {rep} {name:12}: to host {size / d2h / 1e6:5.1f} GB/s, "
                  f"to device {size / h2d / 1e6:5.1f} GB/s", flush=True)
    del host_view
    ok(cu.cuMemUnmap(shadow, size))
    ok(cu.cuMemAddressFree(shadow, size))
    for h in hs:
        ok(cu.cuMemRelease(h))


def pipeline() -> None:
    size = 8 * GiB
    n = size // PIECE
    prop, dev_access = device_props()
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    shadow = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    hosts = [ok(cu.cuMemCreate(PIECE, host_prop(), 0)) for _ in range(n)]
    for k, h in enumerate(hosts):
        ok(cu.cuMemMap(shadow + k * PIECE, PIECE, 0, h, 0))
    ok(cu.cuMemSetAccess(shadow, size, [dev_access, host_access()], 2))
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(n)]

    def map_device() -> list:
        ds = []
        for k in range(n):
            d = ok(cu.cuMemCreate(PIECE, prop, 0))
            ok(cu.cuMemMap(va + k * PIECE, PIECE, 0, d, 0))
            ds.append(d)
        ok(cu.cuMemSetAccess(va, size, [dev_access], 1))
        return ds

    devs = map_device()
    gen = torch.Generator(device="cuda").manual_seed(1)
    v = view(va, size)
    v.view(torch.int64).random_(generator=gen)
    expect = v.view(torch.int64)[:: 1 << 16].clone()
    sums = v.view(torch.int64).sum().item()
    del v
    for rep in range(3):
        torch.cuda.synchronize()
        # copies alone
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            for k in range(n):
                ok(cu.cuMemcpyAsync(shadow + k * PIECE, va + k * PIECE, PIECE, stream.cuda_stream))
        stream.synchronize()
        t_copies = ms(t)
        # the pause: copy, then as each lands, swap its piece for the host handle
        t = time.perf_counter()
        for k in range(n):
            ok(cu.cuMemcpyAsync(shadow + k * PIECE, va + k * PIECE, PIECE, stream.cuda_stream))
            events[k].record(stream)
        t_swap = 0.0
        for k in range(n):
            events[k].synchronize()
            s = time.perf_counter()
            ok(cu.cuMemUnmap(va + k * PIECE, PIECE))
            ok(cu.cuMemRelease(devs[k]))
            ok(cu.cuMemMap(va + k * PIECE, PIECE, 0, hosts[k], 0))
            ok(cu.cuMemSetAccess(va + k * PIECE, PIECE, [dev_access], 1))
            t_swap += ms(s)
        t_pause = ms(t)
        free, _ = ok(cu.cuMemGetInfo())
        print(f"4. rep {rep}: copies alone {t_copies:6.1f} ms ({size / t_copies / 1e6:4.1f} GB/s); "
              f"soft pause {t_pause:6.1f} ms ({size / t_pause / 1e6:4.1f} GB/s), of it swapping {t_swap:5.1f} ms; "
              f"device free {free / GiB:.1f} GiB", flush=True)
        # a kernel on the soft-paused tensor
        v = view(va, size).view(torch.int64)
        torch.cuda.synchronize()
        t = time.perf_counter()
        got = v.sum().item()
        t_read = ms(t)
        right = bool(torch.equal(v[:: 1 << 16], expect)) and got == sums
        t = time.perf_counter()
        v[:: 1 << 16].add_(1)
        torch.cuda.synchronize()
        t_write = ms(t)
        print(f"5. rep {rep}: kernel read 8 GiB {t_read:6.1f} ms ({size / t_read / 1e6:4.1f} GB/s), "
              f"right bytes {right}; strided write {t_write:.2f} ms", flush=True)
        del v
        # the resume, piece by piece
        torch.cuda.synchronize()
        t = time.perf_counter()
        devs = []
        t_swap = 0.0
        for k in range(n):
            s = time.perf_counter()
            ok(cu.cuMemUnmap(va + k * PIECE, PIECE))
            d = ok(cu.cuMemCreate(PIECE, prop, 0))
            ok(cu.cuMemMap(va + k * PIECE, PIECE, 0, d, 0))
            ok(cu.cuMemSetAccess(va + k * PIECE, PIECE, [dev_access], 1))
            t_swap += ms(s)
            devs.append(d)
            ok(cu.cuMemcpyAsync(va + k * PIECE, shadow + k * PIECE, PIECE, stream.cuda_stream))
        stream.synchronize()
        t_resume = ms(t)
        v = view(va, size).view(torch.int64)
        kept = bool(torch.equal(v[:: 1 << 16], expect + 1))
        v[:: 1 << 16].sub_(1)
        torch.cuda.synchronize()
        del v
        print(f"6. rep {rep}: soft resume {t_resume:6.1f} ms ({size / t_resume / 1e6:4.1f} GB/s), "
              f"of it swapping {t_swap:5.1f} ms; the write made while paused is there: {kept}", flush=True)
    torch.cuda.synchronize()
    ok(cu.cuMemUnmap(va, size))
    ok(cu.cuMemUnmap(shadow, size))
    for h in devs + hosts:
        ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(va, size))
    ok(cu.cuMemAddressFree(shadow, size))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--cpu-access":
        cpu_access_child()
        return
    torch.zeros(1, device="cuda")
    creation()
    print("2. CPU access through a VMM host mapping (child process):", flush=True)
    r = subprocess.run([sys.executable, __file__, "--cpu-access"], capture_output=True, text=True, timeout=120)
    print(r.stdout + r.stderr[-800:] + f"   child exit {r.returncode}", flush=True)
    copy_speeds()
    pipeline()


if __name__ == "__main__":
    main()
