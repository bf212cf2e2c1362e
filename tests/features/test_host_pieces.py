"""A resume maps a large backed-up allocation in pieces (so each piece's copy runs while the
next piece is created): the address and the content stay what they were, each piece is its
own physical memory, and pause, free and every failure take all the pieces along.

The host backend's resume piece is 4 granules: with 64 KiB granules, the 17-granule
allocation below resumes as 4 pieces of 256 KiB and one of 64 KiB (5 memfds)."""

from __future__ import annotations

import os

import pytest

from host_memory import open_memfds, resident_pages
from torch_mem_saver_lite import MemorySaverError, OutOfMemoryError
from torch_mem_saver_lite.testing import HostSaver

KiB = 1 << 10
GRANULE = 64 * KiB
BIG = 17 * GRANULE  # 5 pieces, the last one short
BIG_PIECES = 5


@pytest.fixture
def big(mem):
    """A saver with one filled backed-up allocation of BIG bytes ("weights"), and the memfd
    count before it."""
    baseline = open_memfds()
    saver = HostSaver(granularity_bytes=GRANULE)
    saver.stray_access = "off"  # paused memory unmapped: the pieces' own maps and unmaps are counted
    with saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(BIG)
    content = os.urandom(BIG)
    mem.write(ptr, content)
    yield saver, ptr, content, baseline
    saver.close()
    assert open_memfds() == baseline, "physical memory left behind"


def test_resume_maps_a_large_backup_in_pieces_and_keeps_every_byte(big, mem):
    saver, ptr, content, baseline = big
    assert open_memfds() == baseline + 1  # allocated in one piece
    for _ in range(3):
        saver.pause()
        assert resident_pages(ptr, BIG) == 0
        assert open_memfds() == baseline
        saver.resume()
        assert open_memfds() == baseline + BIG_PIECES
        assert mem.read(ptr, BIG) == content  # same address, every byte, across piece edges
    new = os.urandom(BIG)
    mem.write(ptr, new)  # all pieces writable
    saver.pause()
    saver.resume()
    assert mem.read(ptr, BIG) == new
    mem.free(ptr)
    assert open_memfds() == baseline
    assert resident_pages(ptr, BIG) is None  # the address range is given back too


def test_only_backed_up_allocations_larger_than_a_piece_are_split(mem):
    baseline = open_memfds()
    saver = HostSaver(granularity_bytes=GRANULE)
    saver.stray_access = "off"  # paused memory unmapped: the pieces' own maps and unmaps are counted
    try:
        with saver.region("weights", enable_cpu_backup=True):
            small = mem.malloc(4 * GRANULE)  # exactly one piece
        with saver.region("kv"):
            mem.malloc(BIG)  # no backup: nothing to copy while mapping, one piece
        mem.write(small, b"\x5a" * 4 * GRANULE)
        saver.pause()
        saver.resume()
        assert open_memfds() == baseline + 2
        assert mem.read(small, 4 * GRANULE) == b"\x5a" * 4 * GRANULE
    finally:
        saver.close()
    assert open_memfds() == baseline


@pytest.mark.parametrize("operation, after", [
    ("create_physical", 1), ("create_physical", 3), ("map", 2), ("map", BIG_PIECES),
    ("set_access", 4), ("copy_from_host_async", 3),
])
def test_a_resume_failing_midway_through_the_pieces_takes_them_all_back(big, mem, operation, after):
    saver, ptr, content, baseline = big
    saver.pause()
    saver.inject_fault(operation, after)
    with pytest.raises(MemorySaverError, match=rf"injected fault in {operation}") as caught:
        saver.resume()
    assert "stays paused with its backups kept" in str(caught.value)
    assert open_memfds() == baseline, "pieces mapped by the failed resume were kept"
    assert resident_pages(ptr, BIG) == 0
    assert saver.stats()["weights"].paused_bytes == BIG
    saver.resume()
    assert mem.read(ptr, BIG) == content


def pause_in_pieces_failing_at(saver, operation: str, after: int, match: str) -> None:
    """Resumes the allocation once (so it is in pieces), then pauses it with `operation`
    failing at its `after`-th call; the pause must raise an error matching `match`."""
    saver.pause()
    saver.resume()
    saver.inject_fault(operation, after)
    with pytest.raises(MemorySaverError, match=match):
        saver.pause()


def test_a_pause_whose_first_unmap_fails_keeps_every_piece_resident(big, mem):
    saver, ptr, content, baseline = big
    pause_in_pieces_failing_at(saver, "unmap", 1, "stays resident with its content")
    assert open_memfds() == baseline + BIG_PIECES
    assert mem.read(ptr, BIG) == content
    saver.pause()
    saver.resume()
    assert mem.read(ptr, BIG) == content


@pytest.mark.parametrize("operation, after", [("unmap", 3), ("release_physical", 2)])
def test_a_piece_that_fails_to_go_in_a_pause_is_kept_and_released_later(big, mem, operation, after):
    """The pieces before it are gone, so the allocation is paused (its backup is complete);
    the piece is kept as an orphan and released before the next resume maps the range."""
    saver, ptr, content, baseline = big
    pause_in_pieces_failing_at(saver, operation, after, rf"injected fault in {operation}")
    assert open_memfds() == baseline + 1  # the one piece that failed, kept, not leaked
    assert saver.stats()["weights"].paused_bytes == BIG
    saver.resume()  # releases it first, then maps every piece afresh
    assert open_memfds() == baseline + BIG_PIECES
    assert mem.read(ptr, BIG) == content


def test_a_range_is_given_back_only_once_no_piece_is_mapped_in_it(big, mem):
    saver, ptr, content, baseline = big
    pause_in_pieces_failing_at(saver, "unmap", 3, "injected fault in unmap")  # piece 2 stays mapped, an orphan
    orphan = ptr + 2 * 4 * GRANULE
    saver.inject_fault("unmap", 1)
    # Its first retry fails again, the next one (before free returns) unmaps it. Had the
    # range been given back under it, that unmap would map the orphan's address anew.
    mem.free(ptr)
    assert open_memfds() == baseline
    assert resident_pages(orphan, 4 * GRANULE) is None, "the range was given back while a piece was mapped in it"
    assert resident_pages(ptr, BIG) is None


def test_a_resume_waits_until_a_piece_left_mapped_is_gone(big, mem):
    """Mapping over a piece an earlier unmap failed on would be refused by the driver; the
    resume says so, leaves everything paused, and the next one succeeds."""
    saver, ptr, content, baseline = big
    pause_in_pieces_failing_at(saver, "unmap", 3, "injected fault in unmap")  # piece 2 stays mapped
    saver.inject_fault("unmap", 1)
    with pytest.raises(MemorySaverError, match="still mapped") as caught:
        saver.resume()
    assert "stays paused with its backups kept" in str(caught.value)
    assert saver.stats()["weights"].paused_bytes == BIG
    saver.resume()
    assert mem.read(ptr, BIG) == content
    with saver.region("kv"):
        other = mem.malloc(GRANULE)
    mem.free(other)  # retries orphans: none may touch the resumed pieces
    assert mem.read(ptr, BIG) == content
    assert open_memfds() == baseline + BIG_PIECES


def test_running_out_of_memory_midway_through_the_pieces_rolls_back_and_a_retry_succeeds(mem):
    baseline = open_memfds()
    saver = HostSaver(capacity_bytes=BIG, granularity_bytes=GRANULE)
    saver.stray_access = "off"  # paused memory unmapped: the pieces' own maps and unmaps are counted
    try:
        with saver.region("weights", enable_cpu_backup=True):
            ptr = mem.malloc(BIG)
        content = os.urandom(BIG)
        mem.write(ptr, content)
        saver.pause("weights")
        with saver.region("kv"):
            kv = mem.malloc(8 * GRANULE)  # room is left for two pieces, not five
        with pytest.raises(OutOfMemoryError, match="stays paused"):
            saver.resume("weights")
        assert open_memfds() == baseline + 1  # only kv: the pieces mapped before were taken back
        mem.free(kv)
        saver.resume("weights")
        assert mem.read(ptr, BIG) == content
    finally:
        saver.close()
    assert open_memfds() == baseline
