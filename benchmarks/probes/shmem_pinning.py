"""How fast fresh host memory becomes page-locked copy targets, anonymous (huge pages) against
/dev/shm files (4 KiB pages where shmem has no huge pages): faulting in, page-locking
(cudaHostRegister) and a device-to-host copy into it, 8 GiB, one thread and several.

    python benchmarks/probes/shmem_pinning.py [--gib 8]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import threading
import time

import torch

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
GiB, MiB = 1 << 30, 1 << 20


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def populate(base: int, size: int, threads: int) -> float:
    piece = size // threads
    start = time.perf_counter()
    workers = [threading.Thread(target=libc.madvise, args=(base + i * piece, piece, MADV_POPULATE_WRITE))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def register(base: int, size: int, ranges: int, threads: int) -> float:
    cudart = torch.cuda.cudart()
    step = size // ranges
    chunks = [(base + i * step, step) for i in range(ranges)]

    def work(part):
        for p, n in part:
            assert cudart.cudaHostRegister(p, n, 0) == 0

    start = time.perf_counter()
    parts = [chunks[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=work, args=(part,)) for part in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    took = time.perf_counter() - start
    for p, _ in chunks:
        cudart.cudaHostUnregister(p)
    return took


def copy_in(base: int, size: int, device: torch.Tensor) -> float:
    cudart = torch.cuda.cudart()
    for off in range(0, size, 64 * MiB):
        cudart.cudaHostRegister(base + off, 64 * MiB, 0)
    host = torch.frombuffer((ctypes.c_uint8 * size).from_address(base), dtype=torch.uint8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for off in range(0, size, 64 * MiB):
        host[off:off + 64 * MiB].copy_(device[off:off + 64 * MiB], non_blocking=True)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    for off in range(0, size, 64 * MiB):
        cudart.cudaHostUnregister(base + off)
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=int, default=8)
    args = parser.parse_args()
    size = args.gib * GiB
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        shmem_huge = f.read().strip()
    print(f"{torch.cuda.get_device_name()}, {args.gib} GiB; shmem huge pages: {shmem_huge}")
    print("| memory | populate threads | populate s | register (64 MiB ranges) threads | register s | copy GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in ("anonymous", "shmem"):
        for fill_threads, reg_threads in ((1, 1), (16, 1), (16, 4), (16, 16)):
            if kind == "anonymous":
                m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                fd = None
            else:
                fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
                os.ftruncate(fd, size)
                m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            base = address(m)
            libc.madvise(base, size, MADV_HUGEPAGE)
            pop = populate(base, size, fill_threads)
            reg = register(base, size, size // (64 * MiB), reg_threads)
            gbs = size / copy_in(base, size, device) / 1e9
            print(f"| {kind} | {fill_threads} | {pop:.3f} | {reg_threads} | {reg:.3f} | {gbs:.1f} |", flush=True)
            del base
            m.close()
            if fd is not None:
                os.close(fd)


if __name__ == "__main__":
    main()
