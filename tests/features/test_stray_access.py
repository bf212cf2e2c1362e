"""Stray access to paused memory without a backup (``stray_access``, "warn" by default): while
such memory is paused its addresses map the saver's small scratch, so code that still touches it
(a data-parallel dummy batch on a sleeping engine's KV cache, vLLM #44395) reads and writes
harmlessly instead of ending the CUDA context; the physical memory is released all the same;
the next pause or resume on the device notices the writes, and the resume warns (or raises)
naming the tag. Checked on each place the core runs (the `backend` fixture; the stand-in driver
cannot fingerprint, so there writes are harmless but not counted), then the scratch's own
failures on the host backend, then the vLLM sequence on a GPU."""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings

import backends
import pytest
import torch
from environment_child import defaults_in_child, run_in_child

from host_memory import scratch_rss_bytes
from torch_mem_saver_lite import MemorySaverError, StrayAccessError, StrayAccessWarning
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def counts(backend) -> bool:
    """Whether the core can see writes there (the stand-in driver launches no kernels)."""
    return backend.name != "stand_in"


def stray_warnings(action) -> list[str]:
    """The StrayAccessWarning messages `action()` gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, StrayAccessWarning)]


@pytest.fixture
def raising(backend):
    """The backend's saver with stray_access "raise", set back afterwards (the CUDA one is the
    process's)."""
    before = backend.saver.stray_access
    backend.saver.stray_access = "raise"
    yield backend
    backend.saver.stray_access = before


def test_paused_memory_without_a_backup_is_harmless_to_touch_and_a_write_is_reported(backend):
    tag, size = backend.tag("kv"), 8 * MiB
    ptr = backend.allocate(tag, size)
    backend.write(ptr, b"\x5a" * size)
    held = backend.held_bytes()
    assert backend.saver.stray_access == "warn"  # the default

    backend.saver.pause(tag)

    assert held - backend.held_bytes() >= size  # the memory is released all the same
    assert backend.is_mapped(ptr)  # but its address answers: the scratch
    backend.write(ptr + MiB, b"stray write")  # a kernel that still uses it: no fault
    backend.read(ptr, size)  # reads too (what they see is undefined)
    told = stray_warnings(lambda: backend.saver.resume(tag))

    seen = 1 if counts(backend) else 0
    assert len(told) == seen and all(repr(tag) in message for message in told), told
    assert backend.saver.stats()[tag].stray_writes == seen
    assert sum(s.stray_writes for s in backend.saver.status() if s.tag == tag) == seen
    backend.write(ptr, b"\x01" * size)  # awake: its own memory again
    assert backend.read(ptr, size) == b"\x01" * size

    # A cycle nothing touches tells nothing; the count stays.
    backend.saver.pause(tag)
    assert stray_warnings(lambda: backend.saver.resume(tag)) == []
    assert backend.saver.stats()[tag].stray_writes == seen


def test_with_raise_the_resume_raises_once_the_tag_is_awake(raising):
    backend = raising
    tag = backend.tag("kv")
    ptr = backend.allocate(tag, 4 * MiB)
    backend.saver.pause(tag)
    backend.write(ptr, b"dummy batch")
    if not counts(backend):
        backend.saver.resume(tag)  # harmless, not seen
        return
    with pytest.raises(StrayAccessError, match=repr(tag)) as raised:
        backend.saver.resume(tag)
    assert raised.value.tags == {tag: 1}
    assert not backend.saver.stats()[tag].paused  # awake: the resume itself succeeded
    backend.write(ptr, b"awake")
    assert backend.read(ptr, 5) == b"awake"


def test_a_region_can_ask_for_the_raw_behaviour(backend):
    raw, caught = backend.tag("raw"), backend.tag("kv")
    with pytest.raises(ValueError, match="stray_access must be one of"):
        with backend.saver.region(raw, stray_access="loud"):
            pass
    if backend.name == "stand_in":  # no torch CUDA to open a region with: what region() sets
        backend.saver._core().set_option("stray_access", "off", tag=raw)
    else:
        with backend.saver.region(raw, stray_access="off"):
            pass
    raw_ptr, caught_ptr = backend.allocate(raw, 4 * MiB), backend.allocate(caught, 4 * MiB)
    backend.saver.pause([raw, caught])
    assert not backend.is_mapped(raw_ptr)  # unmapped: touching it would fault
    assert backend.is_mapped(caught_ptr)
    backend.saver.resume([raw, caught])


def test_the_saver_wide_setting_is_checked_and_applies_from_the_next_pause(host_saver, mem):
    with pytest.raises(ValueError, match=r"stray_access must be one of \('off', 'warn', 'raise'\)"):
        host_saver.stray_access = "quiet"
    with pytest.raises(TypeError):
        host_saver.stray_access = 1
    with host_saver.region("kv"):
        ptr = mem.malloc(4 * MiB)
    host_saver.stray_access = "off"
    host_saver.pause("kv")
    assert backends.permissions(ptr) == "---p"
    host_saver.resume("kv")
    host_saver.stray_access = "warn"
    host_saver.pause("kv")
    assert backends.permissions(ptr).startswith("rw")
    host_saver.resume("kv")


@pytest.mark.parametrize(("value", "mode"), [("off", 0), ("Warn", 1), (" raise ", 2)])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_process_default_comes_from_TMSL_STRAY_ACCESS(value, mode):
    assert defaults_in_child(TMSL_STRAY_ACCESS=value)["stray_access"] == mode
    said = run_in_child("from torch_mem_saver_lite.testing import HostSaver; print(HostSaver().stray_access)",
                        TMSL_STRAY_ACCESS=value)
    assert said.strip() == value.strip().lower()


def test_a_bad_TMSL_STRAY_ACCESS_is_refused_by_name_at_first_use():
    found = defaults_in_child(TMSL_STRAY_ACCESS="loud")
    assert "TMSL_STRAY_ACCESS must be one of off, warn, raise, got 'loud'" in found["first_use"]
    assert found["stray_access"] == 1  # nothing taken from it


def test_a_resume_tells_the_writes_as_the_pause_they_were_made_under_promised(host_saver, mem):
    with host_saver.region("kv"):
        ptr = mem.malloc(4 * MiB)
    host_saver.pause("kv")  # "warn", the default
    host_saver.stray_access = "off"  # from the next pause on: this one stays covered
    ctypes.memset(ptr, 1, 64)
    told = stray_warnings(lambda: host_saver.resume("kv"))
    assert len(told) == 1 and "'kv'" in told[0], told

    host_saver.pause("kv")  # "off" now: the raw behaviour
    assert backends.permissions(ptr) == "---p"
    host_saver.resume("kv")

    host_saver.stray_access = "raise"
    host_saver.pause("kv")
    host_saver.stray_access = "warn"
    ctypes.memset(ptr, 2, 64)
    with pytest.raises(StrayAccessError, match="'kv'"):
        host_saver.resume("kv")


def test_a_region_refused_for_a_paused_tag_leaves_its_stray_access_as_it_was(host_saver, mem):
    with host_saver.region("kv"):
        ptr = mem.malloc(4 * MiB)
    host_saver.pause("kv")
    with pytest.raises(MemorySaverError, match="paused"), host_saver.region("kv", stray_access="off"):
        pass
    ctypes.memset(ptr, 1, 64)
    assert len(stray_warnings(lambda: host_saver.resume("kv"))) == 1

    host_saver.pause("kv")  # still covered: the refused region set nothing
    assert backends.permissions(ptr).startswith("rw")
    host_saver.resume("kv")


def test_a_write_is_counted_for_the_tags_covered_when_it_happened(host_saver, mem):
    with host_saver.region("a"):
        a = mem.malloc(4 * MiB)
    with host_saver.region("b"):
        b = mem.malloc(4 * MiB)
    host_saver.pause("a")
    ctypes.memset(a, 1, 64)
    host_saver.pause("b")  # checks first: the write was made while only "a" was covered
    assert stray_warnings(lambda: host_saver.resume("b")) == []
    told = stray_warnings(lambda: host_saver.resume("a"))
    assert len(told) == 1 and "'a'" in told[0]
    assert (host_saver.stats()["a"].stray_writes, host_saver.stats()["b"].stray_writes) == (1, 0)

    # Both covered: one scratch, so a write is counted for both; each is told at its own resume.
    host_saver.pause(["a", "b"])
    ctypes.memset(b, 2, 64)
    told_a = stray_warnings(lambda: host_saver.resume("a"))
    assert len(told_a) == 1 and "'a'" in told_a[0]
    told_b = stray_warnings(lambda: host_saver.resume("b"))
    assert len(told_b) == 1 and "'b'" in told_b[0]
    assert (host_saver.stats()["a"].stray_writes, host_saver.stats()["b"].stray_writes) == (2, 1)


def scratch_memfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed meanwhile)
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tmsl-scratch")
    return count


def test_the_scratch_is_a_few_small_pieces_whatever_is_paused(mem):
    before = scratch_memfds()
    saver = HostSaver(capacity_bytes=64 * MiB)
    with saver.region("kv"):
        ptrs = [mem.malloc(6 * MiB) for _ in range(10)]  # 60 of the 64 MiB: the scratch is outside it
    # The host backend's ladder: 4 MiB (two granules) and 2 MiB; a 6 MiB range takes one of each,
    # both made with the first allocation.
    assert scratch_memfds() == before + 2
    assert saver._core().stray_scratch_bytes(0) == 6 * MiB
    saver.pause("kv")
    for p in ptrs:
        ctypes.memset(p, 3, 6 * MiB)  # every paused byte touched
    assert scratch_memfds() == before + 2
    assert saver.stats()["kv"].resident_bytes == 0
    # Mapped at every paused byte (RSS counts them there), held once (PSS).
    assert scratch_rss_bytes("Rss") >= 60 * MiB
    assert scratch_rss_bytes("Pss") <= 6 * MiB * scratch_memfds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StrayAccessWarning)
        saver.resume("kv")
    assert saver.stats()["kv"].stray_writes == 1
    saver.close()
    assert scratch_memfds() == before  # given back with the saver


@pytest.mark.parametrize(("operation", "after"), [("map", 1), ("map", 2), ("set_access", 1)])
def test_a_scratch_that_cannot_be_mapped_leaves_the_memory_paused_and_unmapped(mem, operation, after):
    saver = HostSaver()
    with saver.region("kv"):
        ptr = mem.malloc(8 * MiB)  # two 4 MiB pieces: ("map", 2) fails with the first one mapped
    saver._core().inject_fault(operation, after)
    saver.pause("kv")  # released all the same, without the scratch: the raw behaviour
    assert saver.stats()["kv"].paused and backends.permissions(ptr) == "---p"
    saver.resume("kv")
    mem.write(ptr, b"awake")
    assert mem.read(ptr, 5) == b"awake"
    saver.close()


def test_a_scratch_that_cannot_be_unmapped_fails_the_resume_and_a_retry_succeeds(mem):
    saver = HostSaver()
    with saver.region("kv"):
        ptr = mem.malloc(8 * MiB)
    saver.pause("kv")
    saver._core().inject_fault("unmap", 1)
    with pytest.raises(MemorySaverError, match="scratch"):
        saver.resume("kv")
    assert saver.stats()["kv"].paused  # nothing woken
    saver.resume("kv")  # the unmap is retried first
    mem.write(ptr, b"awake")
    assert mem.read(ptr, 5) == b"awake" and not saver.stats()["kv"].paused
    saver.close()


def test_a_write_into_memory_freed_while_paused_is_counted_for_its_tag_not_the_next(host_saver, mem):
    with host_saver.region("a"):
        gone = mem.malloc(4 * MiB)
    with host_saver.region("b"):
        mem.malloc(4 * MiB)
    host_saver.pause("a")
    ctypes.memset(gone, 1, 64)
    mem.free(gone)  # checked before the scratch leaves it (nothing else is covered), range given back
    assert backends.permissions(gone) == "unmapped" and host_saver.stats()["a"].allocations == 0
    host_saver.pause("b")  # the scratch it gets is clean: nothing to blame on "b"
    assert stray_warnings(lambda: host_saver.resume("b")) == []
    told = stray_warnings(lambda: host_saver.resume("a"))
    assert len(told) == 1 and "'a'" in told[0]
    assert (host_saver.stats()["a"].stray_writes, host_saver.stats()["b"].stray_writes) == (1, 0)


def test_a_failed_resume_covers_the_memory_again_and_a_retry_succeeds(mem):
    saver = HostSaver()
    with saver.region("kv"):
        ptr = mem.malloc(8 * MiB)
    saver.pause("kv")
    saver._core().inject_fault("create_physical", 1)
    with pytest.raises(MemorySaverError):
        saver.resume("kv")
    assert saver.stats()["kv"].paused and backends.permissions(ptr).startswith("rw")  # covered again
    ctypes.memset(ptr, 9, 64)  # harmless still
    told = stray_warnings(lambda: saver.resume("kv"))
    assert len(told) == 1 and "'kv'" in told[0]
    mem.write(ptr, b"awake")
    assert mem.read(ptr, 5) == b"awake"
    saver.close()


# ----- on a GPU: the vLLM #44395 sequence --------------------------------------------------
class TinyEngine:
    """An attention step over a KV cache: weights (backed up) and the cache (no backup) in two
    tags, as an inference engine lays them out."""

    def __init__(self, saver, weights: str, cache: str, seed: int = 0) -> None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        with saver.region(weights, enable_cpu_backup=True):
            self.wq, self.wk, self.wv = (torch.randn(256, 256, device="cuda", generator=generator) for _ in range(3))
        with saver.region(cache):
            self.k_cache = torch.zeros(64, 1024, 256, device="cuda")  # 64 MiB each
            self.v_cache = torch.zeros(64, 1024, 256, device="cuda")

    def step(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Writes the batch's keys and values into the cache, then attends over those slots."""
        self.k_cache[0, slots] = x @ self.wk
        self.v_cache[0, slots] = x @ self.wv
        scores = (x @ self.wq) @ self.k_cache[0, slots].T / 16
        return torch.softmax(scores, dim=-1) @ self.v_cache[0, slots]


@pytest.mark.gpu
def test_a_dummy_batch_on_a_sleeping_kv_cache_runs_is_reported_and_the_next_batch_is_exact():
    from cuda_evidence import device_free_bytes, unique_tag
    from torch_mem_saver_lite import saver

    weights, cache = unique_tag("weights"), unique_tag("kv")
    engine, reference = TinyEngine(saver, weights, cache), TinyEngine(saver, unique_tag("w"), unique_tag("c"))
    batch = torch.randn(32, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    slots = torch.arange(100, 132, device="cuda")
    torch.cuda.synchronize()
    free_before = device_free_bytes()

    saver.pause(cache)  # the KV cache sleeps; the weights stay awake
    assert device_free_bytes() - free_before >= 128 * MiB  # all of the cache released
    dummy = engine.step(torch.zeros(32, 256, device="cuda"), slots)  # the data-parallel dummy batch
    graph_input = torch.ones(4, 256, device="cuda")
    engine.k_cache[1, :4] = graph_input  # and a plain write into the sleeping cache
    torch.cuda.synchronize()  # no illegal address: the context lives
    assert dummy.shape == (32, 256)

    with pytest.warns(StrayAccessWarning, match=repr(cache)):
        saver.resume(cache)
    assert saver.stats()[cache].stray_writes >= 1
    assert bool(torch.equal(engine.step(batch, slots), reference.step(batch, slots)))  # bit for bit
