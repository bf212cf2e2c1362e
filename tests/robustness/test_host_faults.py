"""Failure atomicity: driver errors injected into the host backend in the middle of pause,
resume and allocation leave every allocation recoverable, and a retry succeeds."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from host_memory import open_memfds, resident_pages
from torch_mem_saver_lite import MemorySaverError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


@pytest.fixture
def setup(mem):
    """Three backed-up allocations ("weights") and two without backup ("kv"), all filled.
    Paused memory stays unmapped (stray_access "off"): the faults counted here are the pause's
    and resume's own calls, and "resident" is told by the pages mapped; the scratch's own
    failures are test_stray_access.py's."""
    saver = HostSaver()
    saver.stray_access = "off"
    with saver.region("weights", enable_cpu_backup=True):
        weights = [mem.malloc(4 * MiB) for _ in range(3)]
    with saver.region("kv"):
        kv = [mem.malloc(4 * MiB) for _ in range(2)]
    content = {p: os.urandom(4 * MiB) for p in weights + kv}
    for p, data in content.items():
        mem.write(p, data)
    yield saver, weights, kv, content
    saver.close()


def as_tensor(ptr: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * (4 * MiB)).from_address(ptr), dtype=torch.uint8)


def assert_recoverable(saver, weights, kv, content, mem):
    """Each allocation is resident with its content, or paused with a complete backup."""
    for p in weights + kv:
        if resident_pages(p, 4 * MiB):
            assert mem.read(p, 4 * MiB) == content[p], "resident allocation lost its content"
        elif p in weights:
            assert saver.get_cpu_backup(as_tensor(p)).numpy().tobytes() == content[p], "incomplete backup"
    stats = saver.stats()["weights"]
    assert stats.host_backup_bytes >= stats.paused_bytes


@pytest.mark.parametrize("operation, after", [
    ("synchronize_device", 1), ("register_host", 1), ("copy_to_host_async", 1), ("copy_to_host_async", 3),
    ("wait_copies", 1), ("wait_copies", 2), ("wait_copies", 3), ("unmap", 1), ("unmap", 2), ("unmap", 4),
    ("release_physical", 2),
])
def test_failed_pause_loses_nothing_and_retry_succeeds(setup, mem, operation, after):
    """Each allocation is released once its own copy has landed ("wait_copies", after > 1:
    a later copy fails once earlier allocations are paused with their backups)."""
    saver, weights, kv, content = setup
    times = 1
    if operation == "register_host":  # the pause page-locks fresh memory, not memory set aside
        saver.host_cache_bytes = 0
        saver.release_host_cache()
        times = 2  # a failed page-locking is tried again at the copy: that fails too
    saver._core().inject_fault(operation, after, times)
    with pytest.raises(MemorySaverError, match=rf"injected fault in {operation}") as caught:
        saver.pause()
    assert "tag" in str(caught.value) and ("weights" in str(caught.value) or "kv" in str(caught.value))
    assert_recoverable(saver, weights, kv, content, mem)

    saver.pause()
    saver.resume()
    assert all(mem.read(p, 4 * MiB) == content[p] for p in weights)


@pytest.mark.parametrize("operation, after", [
    ("create_physical", 1), ("create_physical", 4), ("map", 1), ("map", 5), ("set_access", 2),
    ("copy_from_host_async", 1), ("copy_from_host_async", 3), ("wait_copies", 1),
])
def test_failed_resume_rolls_back_keeps_backups_and_retry_succeeds(setup, mem, operation, after):
    saver, weights, kv, content = setup
    saver.pause()
    memfds = open_memfds()
    saver._core().inject_fault(operation, after)
    with pytest.raises(MemorySaverError, match=rf"injected fault in {operation}") as caught:
        saver.resume()
    assert "stays paused" in str(caught.value) and "call resume again" in str(caught.value)
    assert open_memfds() == memfds, "physical memory mapped by the failed resume was not released"
    assert all(resident_pages(p, 4 * MiB) == 0 for p in weights + kv)
    assert_recoverable(saver, weights, kv, content, mem)

    saver.resume()
    assert all(mem.read(p, 4 * MiB) == content[p] for p in weights)


@pytest.mark.parametrize("operation", ["reserve", "create_physical", "map", "set_access"])
def test_failed_allocation_leaves_nothing_behind(mem, operation):
    saver = HostSaver()
    saver.stray_access = "off"  # no scratch: the memfds counted are the allocation's
    try:
        memfds = open_memfds()
        saver._core().inject_fault(operation, 1)
        with saver.region("kv"):
            with pytest.raises(MemorySaverError, match=operation):
                mem.malloc(4 * MiB)
            ptr = mem.malloc(4 * MiB)  # the next one works
        assert saver.stats()["kv"].allocations == 1
        mem.free(ptr)
        assert open_memfds() == memfds
    finally:
        saver.close()


def test_fault_injection_rejects_unknown_operations(host_saver):
    with pytest.raises(ValueError, match="cannot inject"):
        host_saver._core().inject_fault("teleport", 1)


def test_memory_whose_release_fails_is_kept_and_released_later_nothing_leaks(mem):
    from host_memory import open_memfds, resident_pages

    baseline = open_memfds()
    saver = HostSaver(capacity_bytes=8 * MiB)
    saver.stray_access = "off"  # the memfds and mappings counted are the allocation's
    with saver.region("kv"):
        first = mem.malloc(4 * MiB)
    saver.inject_fault("release_physical", 1)
    with pytest.raises(MemorySaverError, match="release_physical"):
        saver.pause("kv")  # unmapped, but the driver would not take the memory back
    assert open_memfds() == baseline + 1  # kept, not lost
    saver.resume("kv")  # tries again first: the 8 MiB capacity has room for all of this
    with saver.region("kv"):
        second = mem.malloc(4 * MiB)
    assert open_memfds() == baseline + 2

    saver.inject_fault("release_physical", 1)
    mem.free(first)  # torch's free cannot fail: the memory is kept and retried
    saver.inject_fault("free_reservation", 1)
    mem.free(second)  # an address range that could not be given back is retried too
    saver.close()  # the last try: every handle and range is given back
    range_gone = resident_pages(second, 4 * MiB) is None
    assert open_memfds() == baseline
    assert range_gone
