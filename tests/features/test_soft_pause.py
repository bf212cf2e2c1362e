"""Soft pauses (``soft_pause``, off by default): while a tag is paused, each allocation with a
host backup keeps that copy mapped at its own address. Its device memory is released all the
same; code that still touches the paused tensor reads its exact bytes and writes into the copy
instead of hitting an illegal address; the resume brings back what the copy holds then, and the
wake check takes those writes as the tag's content. Checked on each place the core runs (the
`backend` fixture), then the switches, the failures and the freeing on the host backend, then
kernels and a CUDA graph on a GPU."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from backends import permissions
from environment_child import run_in_child

import patterns
from host_memory import open_memfds, soft_copy_rss_bytes
from torch_mem_saver_lite import MemorySaverError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


# Content without a period: byte i is (i * 131 + seed) % 251 across the whole size.
pattern = partial(patterns.pattern, step=131, period=None)


def wake_verdict(backend) -> str:
    """What a resume's wake check says there (the stand-in driver launches no kernels)."""
    return "unchecked" if backend.name == "stand_in" else "passed"


def is_mapped(address: int) -> bool:
    return permissions(address).startswith("rw")


@pytest.fixture
def soft(backend):
    """The backend's saver with soft pauses on, set back afterwards (the CUDA one is the
    process's)."""
    before = backend.saver.soft_pause
    backend.saver.soft_pause = True
    yield backend
    backend.saver.soft_pause = before


def test_a_soft_paused_allocation_is_released_keeps_its_address_and_answers_with_its_bytes(soft):
    tag, size = soft.tag("weights"), 8 * MiB
    ptr = soft.allocate(tag, size, backup=True)
    content = pattern(size)
    soft.write(ptr, content)
    held = soft.held_bytes()

    soft.saver.pause(tag)

    assert held - soft.held_bytes() >= size  # its device memory is released as ever
    assert soft.is_mapped(ptr)  # and its address answers: the host copy
    assert soft.read(ptr, size) == content  # with the exact bytes
    soft.saver.resume(tag)
    assert soft.read(ptr, size) == content
    assert soft.saver.stats()[tag].last_wake_check == wake_verdict(soft)


def test_a_write_into_a_soft_paused_allocation_is_there_after_the_resume_and_the_wake_check_takes_it(soft):
    tag, size = soft.tag("weights"), 8 * MiB
    ptr = soft.allocate(tag, size, backup=True)
    soft.write(ptr, pattern(size))
    for cycle in range(3):  # the copy kept from one cycle serves the next
        update = pattern(size, seed=cycle + 11)
        soft.saver.pause(tag)
        soft.write(ptr + MiB, update[:MiB])  # a weight update into a sleeping engine
        soft.saver.resume(tag)
        expected = pattern(size) if cycle == 0 else expected  # noqa: F821 (set below)
        expected = expected[:MiB] + update[:MiB] + expected[2 * MiB:]
        assert soft.read(ptr, size) == expected
        assert soft.saver.stats()[tag].last_wake_check == wake_verdict(soft)


def test_without_soft_pause_paused_memory_with_a_backup_is_unmapped_as_before(backend):
    tag, size = backend.tag("weights"), 4 * MiB
    assert backend.saver.soft_pause is False  # the default
    ptr = backend.allocate(tag, size, backup=True)
    backend.write(ptr, pattern(size))
    backend.saver.pause(tag)
    assert not backend.is_mapped(ptr)
    backend.saver.resume(tag)
    assert backend.read(ptr, size) == pattern(size)


# ----- the host backend: switches, failures, freeing --------------------------------------
def test_a_region_chooses_soft_pauses_for_its_tag_alone(host_saver, mem):
    with host_saver.region("weights", enable_cpu_backup=True, soft_pause=True):
        soft = mem.malloc(4 * MiB)
    with host_saver.region("other", enable_cpu_backup=True):
        hard = mem.malloc(4 * MiB)
    mem.write(soft, pattern(4 * MiB))
    mem.write(hard, pattern(4 * MiB, 3))
    host_saver.pause()
    assert is_mapped(soft) and not is_mapped(hard)
    assert mem.read(soft, 4 * MiB) == pattern(4 * MiB)
    host_saver.resume()
    assert mem.read(hard, 4 * MiB) == pattern(4 * MiB, 3)
    with pytest.raises(TypeError, match="soft_pause"):
        with host_saver.region("weights", soft_pause="yes"):
            pass


def test_a_region_refused_for_a_paused_tag_leaves_its_pauses_as_they_were(host_saver, mem):
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    host_saver.pause("weights")
    with pytest.raises(MemorySaverError, match="paused"), host_saver.region("weights", soft_pause=True):
        pass
    host_saver.resume("weights")
    host_saver.pause("weights")
    assert not is_mapped(ptr)  # not soft: the refused region set nothing
    host_saver.resume("weights")


def soft_copies_open() -> int:
    """Handles open on the host backend's soft copies (memfd "tmsl-soft", one per 64 MiB range)."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tmsl-soft")
               for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


def test_the_soft_copy_is_made_ahead_when_the_region_closes_and_the_pause_takes_it(host_saver, mem):
    host_saver.soft_pause = True
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(8 * MiB)
    host_saver.wait_for_released_backups()  # the background work the region's end queued
    made = soft_copies_open()
    assert made >= 1  # set aside during the rollout (the driver makes it slowly)
    mem.write(ptr, pattern(8 * MiB))
    host_saver.pause("weights")
    assert soft_copies_open() == made  # the pause made none
    assert is_mapped(ptr) and mem.read(ptr, 8 * MiB) == pattern(8 * MiB)
    host_saver.resume("weights")


def test_the_environment_turns_soft_pauses_on():
    code = "from torch_mem_saver_lite import saver; print(saver.soft_pause)"
    assert run_in_child(code, TMSL_SOFT_PAUSE="1").strip() == "True"
    assert run_in_child(code).strip() == "False"


def test_freeing_a_soft_paused_allocation_gives_its_copy_and_address_back(host_saver, mem):
    host_saver.soft_pause = True
    before = open_memfds(), soft_copy_rss_bytes()
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(8 * MiB)
    mem.write(ptr, pattern(8 * MiB))
    host_saver.pause("weights")
    assert soft_copy_rss_bytes() >= 8 * MiB
    mem.free(ptr)
    host_saver.wait_for_released_backups()
    assert (open_memfds(), soft_copy_rss_bytes()) == before
    assert not is_mapped(ptr)


def soft_weights(saver, mem, size: int) -> int:
    """A backed-up allocation of `size` bytes holding pattern(size), under tag "weights", with
    soft pauses turned on once the copy set aside when its region closed is made (an ordinary
    one): the pause makes the soft copy itself, so its driver calls can be counted."""
    with saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(size)
    saver.wait_for_released_backups()
    saver.soft_pause = True
    mem.write(ptr, pattern(size))
    return ptr


def test_where_host_memory_the_gpu_maps_cannot_be_made_the_pause_copies_as_before(host_saver, mem):
    ptr = soft_weights(host_saver, mem, 4 * MiB)
    host_saver._core().inject_fault("create_host_physical", 1, 1)
    host_saver.pause("weights")
    assert not is_mapped(ptr)  # paused as without: its copy is ordinary host memory
    host_saver.resume("weights")
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB)


def test_a_copy_that_cannot_be_mapped_at_the_paused_address_leaves_it_paused_as_before(host_saver, mem):
    ptr = soft_weights(host_saver, mem, 4 * MiB)
    # The pause maps the copy for itself (1st), then the device memory at a second address, the
    # copy's source (2nd: fails, so it copies from its own), then the copy at the paused
    # address once the copy has landed (3rd: fails too).
    host_saver._core().inject_fault("map", 2, 2)
    host_saver.pause("weights")
    assert not is_mapped(ptr)
    host_saver.resume("weights")
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB)
    host_saver.pause("weights")  # the next pause is soft again, with the same copy
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB)
    host_saver.resume("weights")


def test_a_swap_that_fails_while_the_copy_runs_is_undone_and_made_once_it_landed(host_saver, mem):
    ptr = soft_weights(host_saver, mem, 4 * MiB)
    # 3rd map: the copy at the paused address while the copy runs; the device memory goes back
    # there, and the copy is mapped there after all once the copy has landed.
    host_saver._core().inject_fault("map", 3, 1)
    host_saver.pause("weights")
    assert is_mapped(ptr) and mem.read(ptr, 4 * MiB) == pattern(4 * MiB)
    host_saver.resume("weights")
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB)


@pytest.mark.parametrize("operation", ["copy_async", "wait_copies"])
def test_a_pause_whose_copy_fails_leaves_the_memory_resident_at_its_address(host_saver, mem, operation):
    ptr = soft_weights(host_saver, mem, 4 * MiB)
    held = open_memfds()
    host_saver._core().inject_fault(operation, 1, 1)
    with pytest.raises(MemorySaverError, match="stays resident"):
        host_saver.pause("weights")
    assert host_saver.status()[0].state == "awake"
    mem.write(ptr, b"\x42" * 16)  # its own device memory, at its address
    assert mem.read(ptr, 4 * MiB) == b"\x42" * 16 + pattern(4 * MiB)[16:]
    assert open_memfds() == held
    host_saver.pause("weights")
    assert mem.read(ptr, 4 * MiB) == b"\x42" * 16 + pattern(4 * MiB)[16:]
    host_saver.resume("weights")


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_large_soft_copy_comes_off_piece_by_piece_and_a_resume_failing_midway_puts_it_back(host_saver, mem):
    # 100 MiB: the copy's ranges of 64 MiB and 36 MiB, the resume's pieces of 8 MiB here (one
    # range spans eight pieces, the second ends inside the last).
    size = 100 * MiB
    ptr = soft_weights(host_saver, mem, size)
    host_saver.pause("weights")
    expected = bytearray(pattern(size))
    for at in (0, 63 * MiB, 64 * MiB, size - 16):
        mem.write(ptr + at, b"\x5a" * 16)
        expected[at:at + 16] = b"\x5a" * 16
    host_saver._core().inject_fault("create_physical", 10, 1)  # the 10th piece: past the first range
    with pytest.raises(MemorySaverError):
        host_saver.resume("weights")
    assert mem.read(ptr, size) == bytes(expected)  # soft again, all of it
    host_saver.resume("weights")
    assert mem.read(ptr, size) == bytes(expected)
    assert host_saver.stats()["weights"].last_wake_check == "passed"


def test_a_copy_that_fails_to_come_off_its_address_fails_the_resume_and_the_next_one_wakes_it(host_saver, mem):
    ptr = soft_weights(host_saver, mem, 4 * MiB)
    host_saver.pause("weights")
    host_saver._core().inject_fault("unmap", 1, 1)  # the copy off the first piece's addresses
    with pytest.raises(MemorySaverError, match="off its address"):
        host_saver.resume("weights")
    assert host_saver.status()[0].state == "paused"
    host_saver.resume("weights")  # the saver unmaps it first now
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB)


def test_a_failed_resume_leaves_the_copy_mapped_at_the_paused_address(host_saver, mem):
    ptr = soft_weights(host_saver, mem, 4 * MiB)
    host_saver.pause("weights")
    host_saver._core().inject_fault("create_physical", 1, 1)
    with pytest.raises(MemorySaverError):
        host_saver.resume("weights")
    assert host_saver.status()[0].state == "paused"
    mem.write(ptr, b"\x42" * 16)  # still soft: touching it works
    host_saver.resume("weights")
    assert mem.read(ptr, 4 * MiB) == b"\x42" * 16 + pattern(4 * MiB)[16:]


def test_a_soft_copy_kept_after_a_resume_counts_against_the_budget_and_goes_with_the_cache(mem):
    saver = HostSaver(capacity_bytes=256 * MiB)
    try:
        saver.soft_pause = True
        with saver.region("weights", enable_cpu_backup=True):
            ptr = mem.malloc(8 * MiB)
        mem.write(ptr, pattern(8 * MiB))
        saver.pause("weights")
        saver.resume("weights")
        assert soft_copy_rss_bytes("Pss") >= 8 * MiB  # kept for the next pause (the cache has room)
        saver.release_host_cache()
        saver.wait_for_released_backups()
        assert soft_copy_rss_bytes("Pss") == 0
        saver.pause("weights")  # made again
        assert mem.read(ptr, 8 * MiB) == pattern(8 * MiB)
        saver.resume("weights")
    finally:
        saver.close()


# ----- a GPU: kernels, graphs ------------------------------------------------------------
@pytest.mark.gpu
def test_kernels_and_a_graph_replayed_by_mistake_compute_right_on_soft_paused_weights():
    from torch_mem_saver_lite import saver

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    tag = f"soft-{os.getpid()}"
    before = saver.soft_pause
    saver.soft_pause = True
    try:
        with saver.region(tag, enable_cpu_backup=True):
            weights = torch.randn(64 * MiB, device="cuda")  # 256 MiB
            x = torch.randn(64 * MiB, device="cuda")
            out = torch.empty_like(x)
        expected_sum = weights.double().sum().item()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.mul(weights, x, out=out)
            with torch.cuda.graph(graph, stream=stream):
                torch.mul(weights, x, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        reference = (weights * x).clone()
        # Every kernel above has run before the pause starts: a CUDA error raised here is theirs
        # (or a background thread's), one raised by the pause is the pause's own.
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]

        saver.pause(tag)
        # weights, x, out released (less the page tables that map their copies meanwhile)
        assert torch.cuda.mem_get_info()[0] - free_awake >= 0.98 * 3 * 256 * MiB
        assert weights.double().sum().item() == expected_sum  # a kernel reads the exact bytes
        out.zero_()
        graph.replay()  # replayed by mistake while paused
        torch.cuda.synchronize()
        assert torch.equal(out, reference)  # right, over the link
        weights.mul_(2)  # a write while paused
        torch.cuda.synchronize()
        saver.resume(tag)

        assert torch.equal(weights * x, reference * 2)
        assert saver.stats()[tag].last_wake_check == "passed"
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reference * 2)
    finally:
        saver.soft_pause = before
