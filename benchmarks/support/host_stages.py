"""The stages of preparing fresh host memory for a first pause's backups, each measured alone:
faulting pages in (the kernel zeroes them), page-locking them, and faulting in while a
device-to-host copy runs (both write host memory). The first cycle cannot beat the slowest
stage of the three when they overlap perfectly."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections.abc import Callable

import torch

MiB = 1 << 20
PIECE = 64 * MiB  # as the saver's arena: pieces and page-locked ranges of 64 MiB


def _libcuda() -> tuple[ctypes.CDLL, ctypes.c_void_p]:
    libcuda = ctypes.CDLL("libcuda.so.1")  # ctypes calls release the GIL: threads really run in parallel
    libcuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    libcuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    context = ctypes.c_void_p()
    assert libcuda.cuCtxGetCurrent(ctypes.byref(context)) == 0 and context.value, "torch has made no context current"
    return libcuda, context


class FreshMemory:
    """Anonymous memory with huge pages advised, not yet touched, cut into 64 MiB pieces."""

    def __init__(self, size: int):
        self.buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf.madvise(mmap.MADV_HUGEPAGE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.pieces = [(self.address + o, min(PIECE, size - o)) for o in range(0, size, PIECE)]

    def close(self) -> None:
        self.address = 0  # the buffer cannot close while a ctypes object points into it
        self.buf.close()


def in_parallel(work: Callable[[int, int], None], pieces: list[tuple[int, int]], threads: int) -> float:
    """Seconds for `threads` threads to call work(start, length) on every piece."""
    def run(part: list[tuple[int, int]]) -> None:
        for start, length in part:
            work(start, length)

    workers = [threading.Thread(target=run, args=(pieces[t::threads],)) for t in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def fault_in(start: int, length: int) -> None:
    ctypes.memset(start, 0, length)


def page_locker() -> tuple[Callable[[int, int], None], Callable[[list[tuple[int, int]]], None]]:
    """(lock(start, length), unlock_all(pieces)) through the driver, on torch's context."""
    libcuda, context = _libcuda()

    def lock(start: int, length: int) -> None:
        libcuda.cuCtxSetCurrent(context)
        assert libcuda.cuMemHostRegister_v2(start, length, 0) == 0, "cuMemHostRegister failed"

    def unlock_all(pieces: list[tuple[int, int]]) -> None:
        for start, _ in pieces:
            libcuda.cuMemHostUnregister(start)

    return lock, unlock_all


def stage_speeds(size: int, fault_threads: int) -> dict[str, float]:
    """GB/s of each stage for `size` bytes: fault in on `fault_threads` threads; page-lock the
    faulted pieces on one thread (as the saver does); fault in while a D2H copy of the same
    size runs into pinned memory."""
    lock, unlock_all = page_locker()
    fresh = FreshMemory(size)
    fault_s = in_parallel(fault_in, fresh.pieces, fault_threads)
    lock_s = in_parallel(lock, fresh.pieces, 1)
    unlock_all(fresh.pieces)
    fresh.close()

    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    fresh = FreshMemory(size)
    torch.cuda.synchronize()
    pinned.copy_(device, non_blocking=True)
    contended_s = in_parallel(fault_in, fresh.pieces, fault_threads)
    torch.cuda.synchronize()
    fresh.close()
    del device, pinned
    return {"fault_in_gbps": size / fault_s / 1e9, "page_lock_gbps": size / lock_s / 1e9,
            "fault_in_during_copy_gbps": size / contended_s / 1e9}



def fault_in_speed(size: int, threads: int) -> float:
    """GB/s at which `threads` threads fault in `size` bytes of fresh memory right now: on a
    virtual machine this varies over a run (its first touches since boot, and memory the
    guest handed back to the hypervisor, run at a fraction of the usual speed)."""
    fresh = FreshMemory(size)
    seconds = in_parallel(fault_in, fresh.pieces, threads)
    fresh.close()
    return size / seconds / 1e9
