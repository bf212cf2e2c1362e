"""Pause/resume semantics on the host backend, through the same C ABI and hook as the GPU path."""

from __future__ import annotations

import os

import pytest
import torch

from host_memory import open_memfds, resident_pages, rss_shmem_bytes

MiB = 1 << 20


def test_pause_releases_pages_and_resume_maps_fresh_zero_pages_at_same_address(host_saver, mem):
    size = 32 * MiB
    with host_saver.region("kv"):
        ptr = mem.malloc(size)
    mem.write(ptr, b"\xab" * size)
    shmem_before, memfds_before = rss_shmem_bytes(), open_memfds()
    assert resident_pages(ptr, size) == size // 4096

    host_saver.pause("kv")

    assert shmem_before - rss_shmem_bytes() >= size
    assert open_memfds() == memfds_before - 1  # the physical memory itself is gone
    assert resident_pages(ptr, size) == 0  # VA still reserved, nothing behind it
    stats = host_saver.stats()["kv"]
    assert (stats.resident_bytes, stats.paused_bytes, stats.host_backup_bytes) == (0, size, 0)

    host_saver.resume("kv")

    assert mem.read(ptr, size) == bytes(size)  # fresh memory, same address
    mem.write(ptr, b"\x01" * size)
    assert mem.read(ptr, 16) == b"\x01" * 16
    assert host_saver.stats()["kv"].resident_bytes == size


def test_backup_keeps_content_byte_for_byte(host_saver, mem):
    sizes = [8 * MiB, 3 * MiB + 123, 1]
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(s) for s in sizes]
    contents = [os.urandom(s) for s in sizes]
    for ptr, data in zip(ptrs, contents, strict=True):
        mem.write(ptr, data)
    shmem_before = rss_shmem_bytes()

    host_saver.pause("weights")

    reserved = host_saver.stats()["weights"].reserved_bytes
    assert shmem_before - rss_shmem_bytes() >= sum(sizes)
    assert host_saver.stats()["weights"].host_backup_bytes == reserved
    assert all(resident_pages(p, s) == 0 for p, s in zip(ptrs, sizes, strict=True))

    host_saver.resume("weights")

    for ptr, data in zip(ptrs, contents, strict=True):
        assert mem.read(ptr, len(data)) == data
    # Kept for the next pause when the host cache has room for it, else released.
    kept = reserved if reserved <= host_saver.host_cache_bytes else 0
    assert host_saver.stats()["weights"].host_backup_bytes == kept


def test_pause_selects_tags(host_saver, mem):
    with host_saver.region("a"):
        mem.malloc(4 * MiB)
    with host_saver.region("b"):
        b = mem.malloc(4 * MiB)
    mem.write(b, b"keep")

    host_saver.pause("a")
    stats = host_saver.stats()
    assert stats["a"].paused_bytes == 4 * MiB and stats["b"].resident_bytes == 4 * MiB
    assert mem.read(b, 4) == b"keep"

    host_saver.pause(["a", "b"])
    assert host_saver.stats()["b"].paused_bytes == 4 * MiB
    host_saver.resume(["b"])
    assert host_saver.stats()["a"].paused_bytes == 4 * MiB
    host_saver.resume()
    assert all(s.paused_bytes == 0 for s in host_saver.stats().values())


def test_double_pause_and_double_resume_are_noops(host_saver, mem):
    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"data")
    host_saver.pause("kv")
    first = host_saver.stats()
    host_saver.pause("kv")
    assert host_saver.stats() == first  # backups not taken again from unmapped memory
    host_saver.resume("kv")
    host_saver.resume("kv")
    assert mem.read(ptr, 4) == b"data"


def test_stats_carry_the_last_pause_and_resume_time_of_each_tag(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(16 * MiB)
    with host_saver.region("weights", enable_cpu_backup=True):
        mem.malloc(8 * MiB)
    with host_saver.region("empty"):
        pass
    before = host_saver.stats()
    assert all(s.last_pause_seconds is None and s.last_resume_seconds is None for s in before.values())

    host_saver.pause(["kv", "empty"])
    kv = host_saver.stats()["kv"]
    assert kv.last_pause_seconds is not None and kv.last_pause_seconds > 0
    assert kv.last_resume_seconds is None
    assert host_saver.stats()["weights"].last_pause_seconds is None  # not covered
    assert host_saver.stats()["empty"].last_pause_seconds is None  # covered, nothing released

    host_saver.pause()  # releases only "weights" now: "kv"'s figure is the call that released it
    after = host_saver.stats()
    assert after["kv"].last_pause_seconds == kv.last_pause_seconds
    assert after["weights"].last_pause_seconds is not None and after["weights"].last_pause_seconds > 0

    host_saver.resume()
    host_saver.release_host_cache()  # backups kept for the next pause would differ too
    resumed = host_saver.stats()
    assert resumed["kv"].last_resume_seconds == resumed["weights"].last_resume_seconds > 0  # one call
    assert resumed == before  # timings are history, not state: equality ignores them


def test_free_of_paused_allocation_releases_everything(host_saver, mem):
    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(8 * MiB)
    host_saver.pause("kv")
    assert host_saver.stats()["kv"].host_backup_bytes > 0

    mem.free(ptr)

    stats = host_saver.stats()["kv"]
    assert (stats.allocations, stats.reserved_bytes, stats.resident_bytes, stats.paused_bytes,
            stats.host_backup_bytes) == (0, 0, 0, 0, 0)
    assert stats.paused  # the tag itself stays paused until resumed
    assert resident_pages(ptr, 8 * MiB) is None  # the address range itself is returned


def test_allocations_are_rounded_to_the_granularity(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(1)
        mem.malloc(2 * MiB + 1)
    assert host_saver.stats()["kv"].reserved_bytes == 2 * MiB + 4 * MiB


def test_paused_context_manager_resumes_when_the_body_raises(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
    with pytest.raises(KeyError):
        with host_saver.paused("kv"):
            assert host_saver.stats()["kv"].paused_bytes == 2 * MiB
            raise KeyError("train step failed")
    assert host_saver.stats()["kv"].resident_bytes == 2 * MiB


def test_regions_nest_and_restore_the_outer_tag(host_saver, mem):
    with host_saver.region("outer"):
        mem.malloc(2 * MiB)
        with host_saver.region("inner"):
            mem.malloc(4 * MiB)
        mem.malloc(2 * MiB)
    stats = host_saver.stats()
    assert stats["outer"].reserved_bytes == 4 * MiB and stats["inner"].reserved_bytes == 4 * MiB
    with pytest.raises(Exception, match="outside saver.region"):
        mem.malloc(2 * MiB)  # out of every region: the hook refuses, nothing is allocated


def test_get_cpu_backup_returns_the_host_copy_while_paused(host_saver, mem):
    import ctypes

    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    tensor = torch.frombuffer((ctypes.c_uint8 * (4 * MiB)).from_address(ptr), dtype=torch.float32)
    tensor.copy_(torch.randn(tensor.numel()))
    expected = tensor.clone()
    assert host_saver.get_cpu_backup(tensor) is None  # resident: no host copy exists

    host_saver.pause("weights")
    backup = host_saver.get_cpu_backup(tensor)
    view = host_saver.get_cpu_backup(tensor[1024:2048], zero_copy=True)

    assert torch.equal(backup, expected)
    assert torch.equal(view, expected[1024:2048])
    host_saver.resume("weights")
    assert torch.equal(tensor, expected)


def test_a_backup_larger_than_a_page_locked_range_round_trips_in_parts_and_leases_whole(host_saver, mem):
    import ctypes

    # 150 MiB is page-locked in three ranges while the pause copies (the host backend, like
    # CUDA, refuses a copy that crosses from one registration into the next); a lease makes
    # it one registration, and later cycles copy through that.
    sizes = [3 * MiB, 150 * MiB, 5 * MiB]
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(n) for n in sizes]
    tensors = [torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
               for p, n in zip(ptrs, sizes, strict=True)]
    for cycle in range(3):
        expected = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        for t, e in zip(tensors, expected, strict=True):
            t.copy_(e)
        host_saver.pause("weights")
        if cycle > 0:  # the first cycle copies back in parts, never leased
            leased = host_saver.get_cpu_backup(tensors[1], zero_copy=True)
            assert torch.equal(leased, expected[1])
            del leased
        host_saver.resume("weights")
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True)), f"cycle {cycle}"


def test_get_cpu_backup_rejects_what_it_cannot_serve(host_saver, mem):
    import ctypes

    with host_saver.region("kv"):
        ptr = mem.malloc(2 * MiB)
    in_region = torch.frombuffer((ctypes.c_uint8 * (2 * MiB)).from_address(ptr), dtype=torch.uint8)
    with pytest.raises(ValueError, match="enable_cpu_backup=True"):
        host_saver.get_cpu_backup(in_region)
    with pytest.raises(ValueError, match="not allocated inside a region"):
        host_saver.get_cpu_backup(torch.zeros(16))
    with pytest.raises(ValueError, match="contiguous"):
        host_saver.get_cpu_backup(in_region.view(1024, -1).t())
    with pytest.raises(TypeError):
        host_saver.get_cpu_backup(b"bytes")
