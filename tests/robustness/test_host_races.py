"""Calls that race each other on the host backend: get_cpu_backup against resume and free,
close() against pause and resume. Nothing crashes, nothing reads unmapped memory."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from torch_mem_saver_lite import InvalidArgumentError, MemorySaverError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def tensor_at(ptr: int, size: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)


def test_a_zero_copy_backup_stays_readable_after_resume_and_release(host_saver, mem):
    host_saver.host_cache_bytes = 0  # the resume lets go of the backup at once
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(8 * MiB)
    mem.write(ptr, b"w" * (8 * MiB))
    host_saver.pause("weights")
    backup = host_saver.get_cpu_backup(tensor_at(ptr, 8 * MiB), zero_copy=True)
    host_saver.resume("weights")
    host_saver.wait_for_released_backups()
    mem.free(ptr)
    assert bytes(backup[:4].tolist()) == b"wwww" and int(backup.sum()) == ord("w") * 8 * MiB
    with pytest.raises(TypeError, match="zero_copy"):
        host_saver.get_cpu_backup(backup, zero_copy="no")


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_get_cpu_backup_racing_resume_and_free_reads_the_backup_or_nothing(host_saver, mem):
    host_saver.host_cache_bytes = 0
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(4 * MiB) for _ in range(4)]
    for i, ptr in enumerate(ptrs):
        mem.write(ptr, bytes([i + 1]) * (4 * MiB))
    views = [tensor_at(p, 4 * MiB) for p in ptrs]
    stop, seen, errors = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            for i, view in enumerate(views):
                try:
                    copy = host_saver.get_cpu_backup(view)
                except InvalidArgumentError:
                    continue  # freed meanwhile
                if copy is not None:
                    seen.append(int(copy.sum()) == (i + 1) * 4 * MiB)

    def cycler():
        try:
            for _ in range(200):
                host_saver.pause("weights")
                host_saver.resume("weights")
            host_saver.pause("weights")
            for ptr in ptrs:
                mem.free(ptr)  # freed while paused, under the reader
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            stop.set()

    threads = [threading.Thread(target=reader), threading.Thread(target=reader), threading.Thread(target=cycler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert seen and all(seen)


def test_close_racing_pause_and_resume_waits_for_them_and_then_refuses(mem):
    saver = HostSaver()
    with saver.region("kv", enable_cpu_backup=True):
        for _ in range(8):
            mem.malloc(4 * MiB)
    results = []

    def cycler():
        for _ in range(500):
            try:
                saver.pause("kv")
                saver.resume("kv")
            except (InvalidArgumentError, MemorySaverError) as error:
                results.append(str(error))
                return
        results.append("finished")

    thread = threading.Thread(target=cycler)
    thread.start()
    saver.close()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert results and ("finished" in results or "destroyed saver handle" in results[0] or
                        "has been closed" in results[0]), results
    with pytest.raises(MemorySaverError, match="has been closed"):
        saver.pause("kv")


def test_a_zero_copy_backup_outlives_its_saver(mem):
    saver = HostSaver()
    with saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"v" * (4 * MiB))
    saver.pause("weights")
    backup = saver.get_cpu_backup(tensor_at(ptr, 4 * MiB), zero_copy=True)
    saver.close()  # the saver and its backend go; the leased host memory stays
    assert int(backup.sum()) == ord("v") * 4 * MiB
    del backup  # the last reference: unregisters and frees through the backend it kept
