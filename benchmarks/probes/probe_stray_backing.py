"""What backing a paused range without a backup (a KV cache) with one small handle costs, on
the GPU machine (for `stray_access`: a stray touch of paused memory without a backup made
harmless), in three questions.

1. Mapping one S-byte handle (device memory or CUDA-VMM host memory, HOST_NUMA) again and
   again over an 8 GiB range, then setting access once over the whole range: how long for
   S = 2, 16, 64 MiB, against the bare unmap + release of 8 GiB that a pause without backup
   does (torch_memory_saver's whole pause).
2. Is one cuMemSetAccess / cuMemUnmap over many mappings of the handle allowed, and how long
   does taking the mappings down take (one call, or one per mapping)?
3. A kernel writing and reading the whole 8 GiB range while it is backed so: no illegal
   address, and how fast; and how long reading the handle's S bytes once (the check for
   stray writes at resume) takes.

    python benchmarks/probes/probe_stray_backing.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: support
from support.driver_calls import device_props, host_props, ok  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


class Raw:
    """A torch view of raw device-visible memory (zero copy)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def view(ptr: int, size: int) -> torch.Tensor:
    return torch.as_tensor(Raw(ptr, size), device="cuda")


def host_prop():
    return host_props()[0]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def bare_pause(size: int) -> tuple[float, float]:
    prop, access = device_props()
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    handle = ok(cu.cuMemCreate(size, prop, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    ok(cu.cuMemSetAccess(va, size, [access], 1))
    view(va, size).fill_(1)
    t_pause = timed(lambda: (ok(cu.cuMemUnmap(va, size)), ok(cu.cuMemRelease(handle))))

    def resume():
        h = ok(cu.cuMemCreate(size, prop, 0))
        ok(cu.cuMemMap(va, size, 0, h, 0))
        ok(cu.cuMemSetAccess(va, size, [access], 1))
        return h

    t = time.perf_counter()
    h = resume()
    t_resume = (time.perf_counter() - t) * 1e3
    ok(cu.cuMemUnmap(va, size))
    ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(va, size))
    return t_pause, t_resume


def stray_backing(where: str, scratch: int, size: int) -> None:
    _, access = device_props()
    if where == "host":
        prop = host_prop()
    else:
        prop, _ = device_props()
    t = time.perf_counter()
    handle = ok(cu.cuMemCreate(scratch, prop, 0))
    t_create = (time.perf_counter() - t) * 1e3
    own = int(ok(cu.cuMemAddressReserve(scratch, 0, 0, 0)))
    ok(cu.cuMemMap(own, scratch, 0, handle, 0))
    ok(cu.cuMemSetAccess(own, scratch, [access], 1))
    view(own, scratch).fill_(0xA5)
    va = int(ok(cu.cuMemAddressReserve(size, 0, 0, 0)))
    n = size // scratch
    for rep in range(3):
        t = time.perf_counter()
        for k in range(n):
            ok(cu.cuMemMap(va + k * scratch, scratch, 0, handle, 0))
        t_map = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        r = cu.cuMemSetAccess(va, size, [access], 1)
        t_access = (time.perf_counter() - t) * 1e3
        one_access = r[0] == cu.CUresult.CUDA_SUCCESS
        if not one_access:
            t = time.perf_counter()
            for k in range(n):
                ok(cu.cuMemSetAccess(va + k * scratch, scratch, [access], 1))
            t_access = (time.perf_counter() - t) * 1e3
        whole, own_view = view(va, size), view(own, scratch)
        t_write = timed(lambda whole=whole: whole.fill_(7))
        t_read = timed(lambda whole=whole: whole.sum(dtype=torch.int64).item())
        t_check = timed(lambda own_view=own_view: bool((own_view == 7).all().item()))
        written = bool((own_view == 7).all().item())
        own_view.fill_(0xA5)
        del whole, own_view
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = cu.cuMemUnmap(va, size)
        one_unmap = r[0] == cu.CUresult.CUDA_SUCCESS
        t_unmap = (time.perf_counter() - t) * 1e3
        if not one_unmap:
            t = time.perf_counter()
            for k in range(n):
                ok(cu.cuMemUnmap(va + k * scratch, scratch))
            t_unmap = (time.perf_counter() - t) * 1e3
        print(f"{where:6} S={scratch // MiB:3} MiB rep {rep}: create {t_create:6.2f} ms, {n:5} maps {t_map:7.2f} ms, "
              f"access ({'one call' if one_access else 'per map'}) {t_access:6.2f} ms, write 8 GiB {t_write:7.2f} ms, "
              f"read {t_read:7.2f} ms, check S {t_check:6.3f} ms (written {written}), "
              f"unmap ({'one call' if one_unmap else 'per map'}) {t_unmap:6.2f} ms", flush=True)
    ok(cu.cuMemAddressFree(va, size))
    ok(cu.cuMemUnmap(own, scratch))
    ok(cu.cuMemAddressFree(own, scratch))
    ok(cu.cuMemRelease(handle))


def main() -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    size = 8 * GiB
    for _ in range(3):
        p, r = bare_pause(size)
        print(f"bare 8 GiB: unmap+release {p:.2f} ms, create+map+access {r:.2f} ms", flush=True)
    for where in ("host", "device"):
        for scratch in (2 * MiB, 16 * MiB, 64 * MiB):
            try:
                stray_backing(where, scratch, size)
            except AssertionError as e:
                print(f"{where} S={scratch // MiB} MiB failed: {e}", flush=True)


if __name__ == "__main__":
    main()
