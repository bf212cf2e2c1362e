"""Where a soft pause's time goes (`soft_pause`; follows probe_soft_pause.py): the driver
calls of the swap (device memory off the tensor's address, its host copy on) one by one, on
their own and beside the copy, for host copies made of handles of several sizes.

For an 8 GiB tensor (one device piece, as a tensor before its first resume; or 32 pieces of
256 MiB, as after a piecewise resume) and its host copy of VMM host handles of 64 MiB, 512 MiB,
2 GiB or 8 GiB:

1. Each call alone, nothing else running: the alias (the device pieces mapped at a second
   address, made readable), unmapping the device pieces at the tensor's address, mapping the
   host handles there, making them readable by the device, unmapping the alias, releasing the
   device memory.
2. The pause as the saver runs it: the alias, the copy queued from it, the swap while the copy
   runs, the wait, the alias and the device memory gone. Total against the copy alone.
3. The same with the alias made before the pause starts (as it would be, made ahead).
4. (--access-alone) The access change alone, at once or split over 4 threads, against device
   memory's; then the pause with the access change split over threads.

    python benchmarks/probes/probe_soft_swap_costs.py [--access-alone]
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
SIZE = 8 * GiB


def host_prop():
    return host_props()[0]


def host_access():
    return host_props()[1]


def now() -> float:
    return time.perf_counter()


def ms(t: float) -> float:
    return (now() - t) * 1e3


class Handles:
    """Handles of `piece` bytes each, mapped in order at an address."""

    def __init__(self, piece: int, handles: list):
        self.piece, self.handles = piece, handles

    def map_at(self, va: int) -> float:
        t = now()
        for k, h in enumerate(self.handles):
            ok(cu.cuMemMap(va + k * self.piece, self.piece, 0, h, 0))
        return ms(t)

    def unmap_at(self, va: int) -> float:
        t = now()
        for k in range(len(self.handles)):
            ok(cu.cuMemUnmap(va + k * self.piece, self.piece))
        return ms(t)


class Host(Handles):
    """The host copy: handles of `piece` bytes, mapped for the host and the device at `at`."""

    def __init__(self, piece: int):
        super().__init__(piece, [ok(cu.cuMemCreate(piece, host_prop(), 0)) for _ in range(SIZE // piece)])
        _, dev = device_props()
        self.at = int(ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
        self.map_at(self.at)
        ok(cu.cuMemSetAccess(self.at, SIZE, [dev, host_access()], 2))

    def free(self) -> None:
        ok(cu.cuMemUnmap(self.at, SIZE))
        ok(cu.cuMemAddressFree(self.at, SIZE))
        for h in self.handles:
            ok(cu.cuMemRelease(h))


class Device(Handles):
    """The tensor's device memory: `count` pieces mapped at `va`."""

    def __init__(self, va: int, count: int):
        prop, self.access = device_props()
        super().__init__(SIZE // count, [ok(cu.cuMemCreate(SIZE // count, prop, 0)) for _ in range(count)])
        self.va = va
        self.map_at(va)
        ok(cu.cuMemSetAccess(va, SIZE, [self.access], 1))

    def release(self) -> float:
        t = now()
        for h in self.handles:
            ok(cu.cuMemRelease(h))
        return ms(t)


def set_access(va: int, access) -> float:
    t = now()
    ok(cu.cuMemSetAccess(va, SIZE, [access], 1))
    return ms(t)


def fill(va: int) -> None:
    class Raw:
        __cuda_array_interface__ = {"shape": (SIZE // 8,), "typestr": "<i8", "data": (va, False), "version": 3}

    torch.as_tensor(Raw(), device="cuda").random_(generator=torch.Generator(device="cuda").manual_seed(3))
    torch.cuda.synchronize()


def threaded_access(va: int, access, threads: int) -> float:
    import threading

    ctx = ok(cu.cuCtxGetCurrent())
    part = SIZE // threads

    def give(k: int) -> None:
        ok(cu.cuCtxSetCurrent(ctx))
        ok(cu.cuMemSetAccess(va + k * part, part, [access], 1))

    t = now()
    workers = [threading.Thread(target=give, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return ms(t)


def one_case(pieces: int, host_piece: int, stream: torch.cuda.Stream, alias_ahead: bool,
             threads: int = 1) -> dict[str, float]:
    _, dev_access = device_props()
    va = int(ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
    alias = int(ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
    host = Host(host_piece)
    device = Device(va, pieces)
    fill(va)
    got: dict[str, float] = {}
    # The copy alone, from the tensor's address.
    t = now()
    ok(cu.cuMemcpyAsync(host.at, va, SIZE, stream.cuda_stream))
    stream.synchronize()
    got["copy alone"] = ms(t)
    if alias_ahead:
        got["alias map (ahead)"] = device.map_at(alias)
        got["alias access (ahead)"] = set_access(alias, dev_access)
    start = now()
    if not alias_ahead:
        got["alias map"] = device.map_at(alias)
        got["alias access"] = set_access(alias, dev_access)
    ok(cu.cuMemcpyAsync(host.at, alias, SIZE, stream.cuda_stream))
    got["unmap device at va"] = device.unmap_at(va)
    got["map host at va"] = host.map_at(va)
    got["host access at va"] = threaded_access(va, dev_access, threads)
    t = now()
    stream.synchronize()
    got["wait for copy"] = ms(t)
    got["unmap alias"] = device.unmap_at(alias)
    got["release device"] = device.release()
    got["pause total"] = ms(start)
    free, _ = ok(cu.cuMemGetInfo())
    got["device free GiB"] = free / GiB
    host.unmap_at(va)
    ok(cu.cuMemAddressFree(va, SIZE))
    ok(cu.cuMemAddressFree(alias, SIZE))
    host.free()
    return got


def main() -> None:
    torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    for pieces in (1, 32):
        for host_piece in (64 * MiB, 512 * MiB, 2 * GiB, 8 * GiB):
            for alias_ahead in (False, True):
                runs = [one_case(pieces, host_piece, stream, alias_ahead) for _ in range(3)]
                keys = runs[0].keys()
                med = {k: sorted(r[k] for r in runs)[1] for k in keys}
                line = ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                print(f"device {pieces:2} piece(s), host {host_piece // MiB:5} MiB handles, alias "
                      f"{'ahead' if alias_ahead else 'in pause'}: {line}; "
                      f"pause at {SIZE / med['pause total'] / 1e6:.1f} GB/s, copy alone "
                      f"{SIZE / med['copy alone'] / 1e6:.1f} GB/s", flush=True)


def access_alone() -> None:
    """How long making 8 GiB of host handles readable by the device takes with nothing else
    running: at once, or split over 4 threads; and against device memory of the same size."""
    _, dev_access = device_props()
    for host_piece in (64 * MiB, 2 * GiB):
        host = Host(host_piece)
        for threads in (1, 4):
            va = int(ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
            host.map_at(va)
            took = threaded_access(va, dev_access, threads)
            unmap = host.unmap_at(va)
            ok(cu.cuMemAddressFree(va, SIZE))
            print(f"host {host_piece // MiB:5} MiB handles: access for the device on {threads} thread(s) "
                  f"{took:.1f} ms, unmap {unmap:.1f} ms", flush=True)
        host.free()
    va = int(ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
    device = Device(va, 1)
    alias = int(ok(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
    device.map_at(alias)
    print(f"device 8 GiB: access for the device {set_access(alias, dev_access):.1f} ms", flush=True)
    device.unmap_at(alias)
    device.unmap_at(va)
    device.release()


def access_beside_the_copy() -> None:
    """The pause again, the access change split over threads."""
    torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    for host_piece in (64 * MiB, 2 * GiB):
        for threads in (1, 4):
            runs = [one_case(1, host_piece, stream, True, threads) for _ in range(3)]
            med = {k: sorted(r[k] for r in runs)[1] for k in runs[0]}
            print(f"pause, host {host_piece // MiB} MiB handles, access on {threads} thread(s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    if "--access-alone" in sys.argv:
        access_alone()
        access_beside_the_copy()
    else:
        main()
