"""Host memory set aside ahead of the first pause: leaving a region of a backed-up tag
prepares, in the background and within the host cache's budget, the host memory its backups
will take, so that even the first pause copies at once. Best effort: whatever is not set
aside, the pause takes itself; nothing is ever lost."""

from __future__ import annotations

import os
import time

import pytest

from children import prelude, run_python
from host_memory import rss_anon_bytes
from torch_mem_saver_lite import MemorySaverError

MiB = 1 << 20


def fill(mem, ptrs: list[int], size: int) -> list[bytes]:
    contents = [os.urandom(1 << 16) * (size >> 16) for _ in ptrs]
    for ptr, content in zip(ptrs, contents, strict=True):
        mem.write(ptr, content)
    return contents


def set_aside(saver, tag: str) -> int:
    saver.wait_for_released_backups()  # the background work has run
    return saver.stats()[tag].host_backup_bytes


def wait_for_rss(at_least: int, baseline: int) -> None:
    """Waits (up to a minute) until the process holds `at_least` more anonymous memory than
    `baseline`: the background workers fault the memory set aside in."""
    deadline = time.monotonic() + 60
    while rss_anon_bytes() - baseline < at_least:
        assert time.monotonic() < deadline, "the memory set aside never arrived"
        time.sleep(0.01)


def test_leaving_a_backed_up_region_sets_its_backups_memory_aside(host_saver, mem):
    host_saver.host_cache_bytes = 200 * MiB
    before = rss_anon_bytes()
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(32 * MiB) for _ in range(3)]
    assert set_aside(host_saver, "weights") == 96 * MiB
    wait_for_rss(96 * MiB, before)  # really host memory, faulted in without any pause
    contents = fill(mem, ptrs, 32 * MiB)
    prepared = rss_anon_bytes()  # the memory set aside and the contents, in this process
    for _ in range(2):
        host_saver.pause("weights")
        assert host_saver.stats()["weights"].paused_bytes == 96 * MiB
        assert rss_anon_bytes() - prepared < 16 * MiB, "the first pause took more host memory"
        host_saver.resume("weights")
        assert all(mem.read(p, 32 * MiB) == c for p, c in zip(ptrs, contents, strict=True))
    assert set_aside(host_saver, "weights") == 96 * MiB  # kept in the cache after the resume


def test_the_first_pause_uses_the_memory_set_aside_and_needs_no_more():
    # With the address space capped just above what the process uses, a pause that had to
    # map its own host memory fails (test_host_backup_memory's out-of-memory test); with the
    # memory set aside at the region's end, the same pause succeeds and keeps every byte.
    code = prelude("import resource", body="""
        mem, saver = HostMemory(), HostSaver()
        saver.host_cache_bytes = 128 << 20
        with saver.region("weights", enable_cpu_backup=True):
            ptrs = [mem.malloc(32 << 20) for _ in range(2)]
        saver.wait_for_released_backups()
        contents = [os.urandom(1 << 16) * 512 for _ in ptrs]
        for p, c in zip(ptrs, contents):
            mem.write(p, c)
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))  # no room for 64 MiB
        saver.pause("weights")
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        s = saver.stats()["weights"]
        print("paused", s.resident_bytes, s.paused_bytes, s.host_backup_bytes)
        saver.resume("weights")
        print("content", [mem.read(p, 32 << 20) for p in ptrs] == contents)
        """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"paused 0 {64 * MiB} {64 * MiB}", "content True"]


@pytest.mark.parametrize("case", ["over budget", "no cache", "no backup", "backup off", "mmap backend",
                                  "beside the cache"])
def test_nothing_is_set_aside_beyond_the_budget_or_for_backups_the_cache_may_not_keep(host_saver, mem, case):
    host_saver.host_cache_bytes = {"over budget": 64 * MiB, "no cache": 0}.get(case, 128 * MiB)
    if case == "beside the cache":  # 64 MiB already set aside for another tag: 96 more do not fit
        with host_saver.region("optimizer", enable_cpu_backup=True):
            other = [mem.malloc(32 * MiB) for _ in range(2)]
        assert set_aside(host_saver, "optimizer") == 64 * MiB
    backup = {"no backup": None, "backup off": False}.get(case, True)
    backend = "mmap" if case == "mmap backend" else None
    with host_saver.region("weights", enable_cpu_backup=backup, cpu_backup_backend=backend):
        ptrs = [mem.malloc(32 * MiB) for _ in range(3)]
    host_saver._core().prepare_backups(None)  # asked for every tag: the core still says no
    assert set_aside(host_saver, "weights") == 0
    assert sum(s.host_backup_bytes for s in host_saver.stats().values()) <= host_saver.host_cache_bytes
    contents = fill(mem, ptrs, 32 * MiB)
    host_saver.pause("weights")  # takes its host memory itself, where it backs up
    host_saver.resume("weights")
    if backup:
        assert [mem.read(p, 32 * MiB) for p in ptrs] == contents
    if case == "beside the cache":
        # No room for both: the pause took the other tag's page-locked memory (its copies are
        # stale while it is resident) before fresh memory, and the cache holds the newest copies.
        assert set_aside(host_saver, "optimizer") == 0
        assert set_aside(host_saver, "weights") == 96 * MiB
        assert len(other) == 2


def test_release_host_cache_and_free_give_the_memory_set_aside_back(host_saver, mem):
    host_saver.host_cache_bytes = 200 * MiB
    before = rss_anon_bytes()
    with host_saver.region("weights", enable_cpu_backup=True):
        weights = [mem.malloc(32 * MiB) for _ in range(3)]
    # Prepared before the next region closes: regions closing while one is prepared are
    # prepared together, in one arena, which a free of only some of it cannot give back.
    host_saver.wait_for_released_backups()
    with host_saver.region("optimizer", enable_cpu_backup=True):
        optimizer = [mem.malloc(32 * MiB) for _ in range(2)]
    assert set_aside(host_saver, "weights") + set_aside(host_saver, "optimizer") == 160 * MiB
    wait_for_rss(160 * MiB, before)
    for ptr in optimizer:
        mem.free(ptr)
    host_saver.wait_for_released_backups()
    assert rss_anon_bytes() - before < 96 * MiB + 16 * MiB, "freeing did not give its memory back"
    host_saver.release_host_cache()
    host_saver.wait_for_released_backups()
    assert set_aside(host_saver, "weights") == 0
    assert rss_anon_bytes() - before < 16 * MiB, "release_host_cache did not give the memory back"
    contents = fill(mem, weights, 32 * MiB)
    host_saver.pause("weights")
    host_saver.resume("weights")
    assert [mem.read(p, 32 * MiB) for p in weights] == contents


def test_pauses_and_frees_racing_the_preparation_lose_nothing(host_saver, mem):
    host_saver.host_cache_bytes = 256 * MiB
    before = rss_anon_bytes()
    for round_ in range(8):
        tag = f"weights{round_}"
        with host_saver.region(tag, enable_cpu_backup=True):
            ptrs = [mem.malloc(16 * MiB) for _ in range(4)]
        contents = fill(mem, ptrs, 16 * MiB)
        if round_ % 2:
            mem.free(ptrs.pop())  # freed while its memory may be being set aside
            contents.pop()
        host_saver.pause(tag)  # at once: the preparation may not have run, or not finished
        stats = host_saver.stats()[tag]
        assert stats.paused_bytes == stats.reserved_bytes == 16 * MiB * len(ptrs)
        assert stats.host_backup_bytes == stats.paused_bytes
        host_saver.resume(tag)
        assert [mem.read(p, 16 * MiB) for p in ptrs] == contents, f"round {round_}"
        for ptr in ptrs:
            mem.free(ptr)
    del contents  # the test's own copies
    host_saver.wait_for_released_backups()
    # Freed memory's host memory went back to the pool (each round reused it): what stays is
    # one round's, within the cache's budget, and release_host_cache gives it back.
    assert rss_anon_bytes() - before < 64 * MiB + 16 * MiB, "host memory grew round after round"
    host_saver.release_host_cache()
    host_saver.wait_for_released_backups()
    assert rss_anon_bytes() - before < 16 * MiB, "host memory set aside for freed memory was kept"


def test_memory_set_aside_counts_whole_while_part_of_it_is_freed(host_saver, mem):
    # Host memory is set aside in one piece per closing region; freeing one allocation of it
    # does not give its part back, so the budget counts the whole piece.
    host_saver.host_cache_bytes = 96 * MiB
    with host_saver.region("a", enable_cpu_backup=True):
        a = [mem.malloc(32 * MiB) for _ in range(2)]
    assert set_aside(host_saver, "a") == 64 * MiB
    mem.free(a.pop())  # 64 MiB still held for "a", 32 of them for nothing
    with host_saver.region("b", enable_cpu_backup=True):
        mem.malloc(32 * MiB)
    assert set_aside(host_saver, "b") == 32 * MiB  # 64 + 32: within the budget
    with host_saver.region("c", enable_cpu_backup=True):
        mem.malloc(32 * MiB)
    assert set_aside(host_saver, "c") == 0  # 64 + 32 + 32 would not be


def test_regions_closing_in_a_row_are_prepared_together_and_waited_for(host_saver, mem):
    host_saver.host_cache_bytes = 200 * MiB
    before = rss_anon_bytes()
    for _layer in range(24):  # a model loaded one region per layer
        with host_saver.region("weights", enable_cpu_backup=True):
            mem.malloc(4 * MiB)
    assert set_aside(host_saver, "weights") == 96 * MiB
    # wait_for_released_backups returned once the memory was faulted in and page-locked
    assert rss_anon_bytes() - before >= 96 * MiB


@pytest.mark.parametrize("times", [1, 2])
def test_a_failed_page_locking_while_setting_aside_is_tried_again_by_the_pause(host_saver, mem, times):
    host_saver.host_cache_bytes = 128 * MiB
    host_saver.inject_fault("register_host", 1, times)  # the background page-locking fails first
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(16 * MiB) for _ in range(3)]
    assert set_aside(host_saver, "weights") == 48 * MiB
    contents = fill(mem, ptrs, 16 * MiB)
    if times == 2:  # the pause's own try fails too: nothing is released, nothing lost
        with pytest.raises(MemorySaverError, match="injected fault in register_host"):
            host_saver.pause("weights")
        assert host_saver.stats()["weights"].resident_bytes == 48 * MiB
        assert [mem.read(p, 16 * MiB) for p in ptrs] == contents
    host_saver.pause("weights")
    assert host_saver.stats()["weights"].paused_bytes == 48 * MiB
    host_saver.resume("weights")
    assert [mem.read(p, 16 * MiB) for p in ptrs] == contents


def test_closing_the_saver_while_memory_is_being_set_aside(mem):
    from torch_mem_saver_lite.testing import HostSaver

    before = rss_anon_bytes()
    for _ in range(4):
        saver = HostSaver()
        saver.host_cache_bytes = 512 * MiB
        with saver.region("weights", enable_cpu_backup=True):
            [mem.malloc(64 * MiB) for _ in range(4)]
        saver.close()  # the preparation may be queued, or faulting pages in
    assert rss_anon_bytes() - before < 64 * MiB, "a closed saver kept host memory"
