"""The seam between Python and the core: the core's tag rules hold for allocations that
arrive without a Python region, refused allocations explain themselves through torch's
error, and a closed saver leaves no thread pointing at it."""

from __future__ import annotations

import ctypes

import pytest
import torch

from torch_mem_saver_lite import InvalidArgumentError, MemorySaverError, OutOfMemoryError, _lib
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def test_tag_rules_hold_for_allocations_that_reach_the_core_directly(host_saver, mem):
    native = host_saver._core()
    native.malloc(2 * MiB, 0, "direct", True)  # no region: straight through the C ABI
    out = ctypes.c_void_p()
    assert _lib.lib().tmsl_malloc(native.handle, 2 * MiB, 0, b"direct", 4, ctypes.byref(out)) != 0
    assert "backup choice from -1 to 3" in str(_lib.last_error())
    native.malloc(2 * MiB, 0, "direct", False)  # each allocation keeps its own choice
    host_saver.pause("direct")
    with pytest.raises(MemorySaverError, match="'direct' is paused"):
        native.malloc(2 * MiB, 0, "direct", True)
    with pytest.raises(ValueError, match=r"unknown tag 'nope'.*'direct'"):
        host_saver.resume("nope")
    host_saver.resume("direct")
    native.malloc(2 * MiB, 0, "direct", None)
    assert host_saver.stats()["direct"].allocations == 3


def torch_like_malloc(size: int) -> None:
    """What torch does when its allocator's malloc returns NULL: raise its own error."""
    if not _lib.lib().tmsl_torch_malloc(size, 0, None):
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")


def test_an_allocation_refused_by_the_margin_explains_torchs_error():
    saver = HostSaver(capacity_bytes=64 * MiB)
    try:
        saver.memory_margin_bytes = 60 * MiB
        with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
            with saver.region("kv"):
                torch_like_malloc(8 * MiB)
        cause = caught.value.__cause__
        assert isinstance(cause, OutOfMemoryError)
        assert "region 'kv'" in str(cause) and "memory margin of 60.00 MiB" in str(cause)
        assert cause.tag == "kv" and cause.bytes_needed == 8 * MiB
    finally:
        saver.close()


def test_errors_that_are_not_the_savers_are_left_alone(host_saver):
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        with host_saver.region("kv"):
            raise torch.cuda.OutOfMemoryError("someone else's allocation")
    assert caught.value.__cause__ is None
    # A failure before the region is not blamed on an error inside it.
    assert not _lib.lib().tmsl_torch_malloc(0, 0, None)
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        with host_saver.region("kv"):
            raise torch.cuda.OutOfMemoryError("unrelated")
    assert caught.value.__cause__ is None


def test_a_closed_saver_leaves_no_thread_pointing_at_it(mem):
    doomed = HostSaver()
    native = doomed._core()
    with doomed.region("kv"):
        mem.malloc(2 * MiB)
        doomed.close()
        with pytest.raises(InvalidArgumentError, match="has been closed"):
            mem.malloc(2 * MiB)
    fresh = HostSaver()  # may reuse the closed saver's slot
    try:
        with fresh.region("kv"):
            mem.malloc(2 * MiB)
        with pytest.raises(InvalidArgumentError, match="destroyed saver handle"):
            native.pause(None)  # the old handle does not reach the new saver
        assert fresh.stats()["kv"].resident_bytes == 2 * MiB
    finally:
        fresh.close()
