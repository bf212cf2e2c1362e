"""Host memory as a pool (tiers/host_pool.h): page-locked memory that a free or a resume lets
go serves the next pause of any tag and any shape, within the host cache's budget; and
background host work (setting memory aside, page-locking it, freeing it) gives way to the
foreground (tiers/foreground_gate.h), checked by what the library counts, never by timing."""

from __future__ import annotations

import ctypes
import hashlib
import os
import time

from host_memory import rss_anon_bytes
from torch_mem_saver_lite import _lib

MiB = 1 << 20


def tiers(saver) -> dict[str, int]:
    out = [ctypes.c_size_t() for _ in range(4)]
    _lib.check(_lib.lib().tmsl_tiers_figures(saver._core().handle, *(ctypes.byref(v) for v in out)))
    return dict(zip(("pooled", "fresh_arenas", "deferrals", "waiting"), (v.value for v in out), strict=True))


def hold_foreground(saver, hold: bool) -> None:
    _lib.check(_lib.lib().tmsl_hold_foreground(saver._core().handle, int(hold)))


def workload(saver, mem, tag: str, sizes: list[int]) -> tuple[list[int], list[bytes]]:
    with saver.region(tag, enable_cpu_backup=True):
        ptrs = [mem.malloc(n) for n in sizes]
    contents = [os.urandom(n) for n in sizes]
    for ptr, data in zip(ptrs, contents, strict=True):
        mem.write(ptr, data)
    return ptrs, contents


def test_pauses_of_other_tags_and_shapes_after_a_free_take_no_new_host_memory(host_saver, mem):
    # Three 48 MiB workloads back to back, as a program that loads, serves and trains in turn:
    # the first's host memory, freed, serves the others' pauses, carved to their shapes.
    host_saver.host_cache_bytes = 128 * MiB
    host_saver.release_host_cache()
    shapes = {"one": [48 * MiB], "weights": [5 * MiB + 4096 * k for k in range(9)], "blocks": [2 * MiB] * 24}
    fresh_after_first = None
    before = rss_anon_bytes()
    for tag, sizes in shapes.items():
        ptrs, contents = workload(host_saver, mem, tag, sizes)
        host_saver.wait_for_released_backups()  # memory set aside as the region closed, if any
        for _ in range(2):
            host_saver.pause(tag)
            assert host_saver.stats()[tag].host_backup_bytes >= sum(sizes)
            host_saver.resume(tag)
            assert [mem.read(p, len(d)) for p, d in zip(ptrs, contents, strict=True)] == contents
        if fresh_after_first is None:
            fresh_after_first = tiers(host_saver)["fresh_arenas"]
        else:
            assert tiers(host_saver)["fresh_arenas"] == fresh_after_first, f"{tag}: new host memory was made"
        for ptr in ptrs:
            mem.free(ptr)
        del contents  # the test's own copies
        host_saver.wait_for_released_backups()
        assert tiers(host_saver)["pooled"] >= sum(sizes)  # the freed copies' memory, pooled at once
        # Host memory really bounded: one workload's worth, not one per workload.
        assert rss_anon_bytes() - before < 48 * MiB + 16 * MiB
    host_saver.release_host_cache()
    assert tiers(host_saver)["pooled"] == 0
    assert rss_anon_bytes() - before < 16 * MiB, "release_host_cache left the pool's memory"


def test_the_pool_keeps_no_more_than_the_cache_budget(host_saver, mem):
    host_saver.host_cache_bytes = 32 * MiB
    host_saver.release_host_cache()
    before = rss_anon_bytes()
    ptrs, contents = workload(host_saver, mem, "big", [48 * MiB])
    del contents  # more than the budget: not set aside
    host_saver.pause("big")
    host_saver.resume("big")
    for ptr in ptrs:
        mem.free(ptr)
    host_saver.wait_for_released_backups()
    assert tiers(host_saver)["pooled"] == 0
    assert rss_anon_bytes() - before < 16 * MiB, "memory over the cache's budget was kept"
    host_saver.host_cache_bytes = 64 * MiB
    ptrs, contents = workload(host_saver, mem, "small", [24 * MiB])
    del contents
    host_saver.pause("small")
    host_saver.resume("small")
    for ptr in ptrs:
        mem.free(ptr)
    host_saver.wait_for_released_backups()
    assert 24 * MiB <= tiers(host_saver)["pooled"] <= 64 * MiB
    host_saver.host_cache_bytes = 16 * MiB  # lowered: applied to the pool at once
    host_saver.wait_for_released_backups()
    assert tiers(host_saver)["pooled"] == 0
    assert rss_anon_bytes() - before < 16 * MiB


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60  # a safety net against a hang, not a timing assertion
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_background_host_work_waits_while_the_foreground_works(host_saver, mem):
    host_saver.host_cache_bytes = 128 * MiB
    host_saver.release_host_cache()
    deferred = tiers(host_saver)["deferrals"]
    hold_foreground(host_saver, True)  # as if an allocation or a pause were under way
    try:
        with host_saver.region("weights", enable_cpu_backup=True):
            mem.malloc(64 * MiB)  # leaving the region sets host memory aside in the background
            before = rss_anon_bytes()
        # The background thread reached the gate and waits there: no page faulted in yet.
        wait_until(lambda: tiers(host_saver)["waiting"] > 0, "the background work never reached the gate")
        assert tiers(host_saver)["deferrals"] > deferred
        assert rss_anon_bytes() - before < 8 * MiB
    finally:
        hold_foreground(host_saver, False)
    host_saver.wait_for_released_backups()
    assert host_saver.stats()["weights"].host_backup_bytes == 64 * MiB  # set aside once the foreground was quiet
    assert tiers(host_saver)["waiting"] == 0
    assert rss_anon_bytes() - before >= 64 * MiB  # faulted in now


def test_a_pause_does_not_wait_for_the_gate_it_holds(host_saver, mem):
    # Memory set aside for a tag whose pause comes while the foreground is busy: the pause
    # needs it, so its preparation stops giving way.
    host_saver.host_cache_bytes = 128 * MiB
    host_saver.release_host_cache()
    hold_foreground(host_saver, True)
    try:
        ptrs, contents = workload(host_saver, mem, "kv", [32 * MiB, 8 * MiB])
        wait_until(lambda: tiers(host_saver)["waiting"] > 0, "the background work never reached the gate")
        host_saver.pause("kv")
        host_saver.resume("kv")
        assert [mem.read(p, len(d)) for p, d in zip(ptrs, contents, strict=True)] == contents
    finally:
        hold_foreground(host_saver, False)


# The benchmark's sequence (benchmarks/bench_back_to_back.py) in miniature: three workloads of
# different shapes, each staying allocated while the next ones run, a cache budget of about 1.8
# of the largest (never room for two), three cycles each. The later ones are smaller: a large
# stale copy serves a much smaller pause of another tag.
BACK_TO_BACK = {
    "one_big": [48 * MiB],
    "weights": [n * MiB for n in (2, 3, 4, 5, 6, 7, 5, 4, 2, 1, 1)],
    "many_small": [2 * MiB] * 20,
}


def digests(mem, ptrs: list[int], sizes: list[int]) -> list[bytes]:
    return [hashlib.sha256(mem.read(p, n)).digest() for p, n in zip(ptrs, sizes, strict=True)]


def test_back_to_back_workloads_that_stay_allocated_take_no_fresh_host_memory(host_saver, mem):
    # A later workload's pause takes the page-locked memory of the resident workloads' cached
    # (stale) copies, whatever their tag and shape, instead of faulting fresh memory in; the
    # cache then holds the newest copies, and host memory stays within the cache's budget and
    # what the paused backups need.
    budget = 86 * MiB
    host_saver.host_cache_bytes = budget
    host_saver.release_host_cache()
    before = rss_anon_bytes()
    fresh_after_first = None
    resident = []
    for tag, sizes in BACK_TO_BACK.items():
        ptrs, contents = workload(host_saver, mem, tag, sizes)
        del contents  # the test keeps digests only: its own memory stays out of the figure
        expected = digests(mem, ptrs, sizes)
        resident.append((ptrs, sizes, expected))
        for _ in range(3):
            host_saver.pause(tag)
            if fresh_after_first is None:
                fresh_after_first = tiers(host_saver)["fresh_arenas"]
            assert tiers(host_saver)["fresh_arenas"] == fresh_after_first, f"{tag}: fresh host memory was made"
            assert host_saver.stats()[tag].host_backup_bytes >= sum(sizes)
            # The copies kept and the pool within the budget, beside this pause's backups.
            assert rss_anon_bytes() - before <= budget + sum(sizes) + 16 * MiB
            host_saver.resume(tag)
            assert digests(mem, ptrs, sizes) == expected
        assert host_saver.stats()[tag].host_backup_bytes >= sum(sizes), f"{tag}: the newest copies were not cached"
    for ptrs, sizes, expected in resident:  # the earlier workloads' content, untouched by the others' pauses
        assert digests(mem, ptrs, sizes) == expected
    host_saver.wait_for_released_backups()
    assert rss_anon_bytes() - before <= budget + 16 * MiB


def test_retained_copies_are_never_taken_by_another_tags_pause(host_saver, mem):
    host_saver.host_cache_bytes = 64 * MiB
    host_saver.release_host_cache()
    host_saver.retain_cpu_backup = True
    kept_ptrs, kept = workload(host_saver, mem, "kept", [32 * MiB])
    host_saver.pause("kept")
    host_saver.resume("kept")
    host_saver.retain_cpu_backup = False
    fresh = tiers(host_saver)["fresh_arenas"]
    ptrs, contents = workload(host_saver, mem, "other", [32 * MiB])
    host_saver.pause("other")
    assert tiers(host_saver)["fresh_arenas"] == fresh + 1  # its own memory: the retained copy stays
    assert host_saver.stats()["kept"].host_backup_bytes == 32 * MiB
    host_saver.resume("other")
    assert [mem.read(p, len(d)) for p, d in zip(ptrs, contents, strict=True)] == contents
    assert [mem.read(p, len(d)) for p, d in zip(kept_ptrs, kept, strict=True)] == kept


def test_a_freed_copy_gives_its_pages_back_range_by_range_each_once_the_foreground_is_quiet(host_saver, mem):
    # Unpinning and freeing gigabytes in one call holds the driver's lock and the memory map
    # long enough to stall an allocation or a copy that starts meanwhile: the background frees
    # a copy one page-locked range (64 MiB) at a time, asking the gate before each.
    host_saver.host_cache_bytes = 16 * MiB  # smaller than the copy: the resume lets it go
    host_saver.release_host_cache()
    # (Three of one range each: a larger backup would be the node's store's, which a resume keeps.)
    ptrs, contents = workload(host_saver, mem, "big", [64 * MiB] * 3)
    host_saver.pause("big")
    held = rss_anon_bytes()
    hold_foreground(host_saver, True)  # never quiet: each wait ends after the gate's longest wait
    try:
        deferred = tiers(host_saver)["deferrals"]
        host_saver.resume("big")
        host_saver.wait_for_released_backups()
        # One wait before the free, then one before each of the copy's three ranges.
        assert tiers(host_saver)["deferrals"] - deferred >= 4
    finally:
        hold_foreground(host_saver, False)
    assert rss_anon_bytes() <= held - 192 * MiB + 16 * MiB, "the copy's pages were not given back"
    assert [mem.read(p, len(d)) for p, d in zip(ptrs, contents, strict=True)] == contents
