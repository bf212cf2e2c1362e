"""Disk backup (enable_disk_backup=True) against the disk's own speed, in one run.

    python benchmarks/bench_disk_backup.py [--gib 8] [--dir DIR] [--cycles 2]

First measures the disk where the backups go: sequential direct I/O of the same size with
dd (one request at a time) and with the access pattern disk backup uses (chunks of 64 MiB,
four requests in flight, no GPU involved). Then pauses and resumes --gib GiB of device
memory in a region with disk backup, checks the content bit for bit, and prints each
pause/resume as GB/s and as a share of the disk's best measured speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import re
import subprocess
import time
from pathlib import Path

import torch
from support.timing import timed_ms

from torch_mem_saver_lite import _lib, saver

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_CHUNK_BYTES, DEFAULT_WORKERS = _lib.disk_backup_settings()  # the core's, as its pauses use them


def filesystem_type(path: str) -> str:
    """The type of the file system holding ``path``, as stat(1) names it."""
    return subprocess.run(["stat", "--file-system", "--format=%T", path], capture_output=True, text=True,
                          check=True).stdout.strip()
ROOT = Path(__file__).resolve().parents[1]


def dd_speed(path: str, nbytes: int, write: bool) -> float:
    """GB/s dd reports for one sequential direct-I/O pass of ``nbytes`` in 64 MiB blocks."""
    count = nbytes // (64 * MiB)
    if write:
        command = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"]
    else:
        command = ["dd", f"if={path}", "of=/dev/null", "bs=64M", f"count={count}", "iflag=direct"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    match = re.search(r"copied, ([0-9.]+) s", result.stderr)
    return nbytes / float(match.group(1) if match else seconds) / 1e9


def _pinned_chunk() -> memoryview:
    """One page-locked chunk, page-aligned, as the disk tier's staging is."""
    raw = torch.empty(DEFAULT_CHUNK_BYTES + 4096, dtype=torch.uint8, pin_memory=True)
    skip = -raw.data_ptr() % 4096
    _PINNED.append(raw)  # kept alive with its view
    return memoryview((ctypes.c_char * DEFAULT_CHUNK_BYTES).from_address(raw.data_ptr() + skip)).cast("B")


_PINNED: list[torch.Tensor] = []


def parallel_speed(path: str, nbytes: int, write: bool) -> float:
    """GB/s of disk backup's own I/O pattern (the core's chunks and workers, O_DIRECT), host only."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        offsets = list(range(0, nbytes, DEFAULT_CHUNK_BYTES))
        buffers = [_pinned_chunk() for _ in range(DEFAULT_WORKERS)]
        if write:
            os.posix_fallocate(fd, 0, nbytes)

        def work(worker: int) -> None:
            buffer = buffers[worker]
            for offset in offsets[worker::DEFAULT_WORKERS]:
                view, at = buffer[:min(DEFAULT_CHUNK_BYTES, nbytes - offset)], offset
                while view:
                    done = os.pwrite(fd, view, at) if write else os.preadv(fd, [view], at)
                    if done == 0:
                        raise OSError("short read")
                    view, at = view[done:], at + done

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(DEFAULT_WORKERS) as pool:
            list(pool.map(work, range(DEFAULT_WORKERS)))
        if write:
            os.fsync(fd)
        return nbytes / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--dir", default=str(ROOT / "build" / "disk-bench"))
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--sweep", action="store_true",
                        help="also one cycle per (requests in flight, chunk size) setting")
    args = parser.parse_args()
    nbytes = int(args.gib * GiB) // (64 * MiB) * (64 * MiB)
    directory, _ = _lib.check_disk_backup_dir(args.dir)
    stat = os.statvfs(directory)
    print(f"directory {directory} ({filesystem_type(directory)}), {stat.f_bavail * stat.f_frsize / GiB:.0f} GiB free; "
          f"GPU {torch.cuda.get_device_name()}; {nbytes / GiB:.1f} GiB per workload")

    probe = os.path.join(directory, "disk-speed.bin")
    disk = {
        "dd write (1 in flight)": dd_speed(probe, nbytes, write=True),
        "dd read (1 in flight)": dd_speed(probe, nbytes, write=False),
    }
    os.unlink(probe)
    disk["parallel write (4 x 64 MiB)"] = parallel_speed(probe, nbytes, write=True)
    disk["parallel read (4 x 64 MiB)"] = parallel_speed(probe, nbytes, write=False)
    os.unlink(probe)
    best_write = max(v for k, v in disk.items() if "write" in k)
    best_read = max(v for k, v in disk.items() if "read" in k)
    print("\n| disk, measured now | GB/s |\n| --- | --- |")
    for name, speed in disk.items():
        print(f"| {name} | {speed:.2f} |")

    saver.set_disk_backup_dir(directory)
    with saver.region("disk_bench", enable_disk_backup=True):
        data = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda")
    reference = data.clone()
    print("\n| cycle | pause s | pause GB/s | share of disk write | resume s | resume GB/s | share of disk read "
          "| bit-identical |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cycle in range(1, args.cycles + 1):
        pause_s = 1e-3 * timed_ms(lambda: saver.pause("disk_bench"))
        resume_s = 1e-3 * timed_ms(lambda: saver.resume("disk_bench"))
        same = bool(torch.equal(data, reference))
        pause_gbs, resume_gbs = nbytes / pause_s / 1e9, nbytes / resume_s / 1e9
        print(f"| {cycle} | {pause_s:.2f} | {pause_gbs:.2f} | {pause_gbs / best_write:.0%} | {resume_s:.2f} "
              f"| {resume_gbs:.2f} | {resume_gbs / best_read:.0%} | {same} |")
        assert same, "content changed across a disk-backed pause"
    if args.sweep:
        print("\n| in flight x chunk | pause GB/s | resume GB/s |\n| --- | --- | --- |")
        for workers, chunk_mb in ((2, 64), (4, 64), (8, 32), (8, 64), (16, 16), (16, 64)):
            os.environ["TMSL_DISK_BACKUP_WORKERS"] = str(workers)
            os.environ["TMSL_DISK_BACKUP_CHUNK_MB"] = str(chunk_mb)
            pause_s = 1e-3 * timed_ms(lambda: saver.pause("disk_bench"))
            resume_s = 1e-3 * timed_ms(lambda: saver.resume("disk_bench"))
            assert torch.equal(data, reference)
            print(f"| {workers} x {chunk_mb} MiB | {nbytes / pause_s / 1e9:.2f} | {nbytes / resume_s / 1e9:.2f} |")


if __name__ == "__main__":
    main()
