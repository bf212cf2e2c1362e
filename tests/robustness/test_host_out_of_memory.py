"""Out-of-memory on the host backend's capacity limit: nothing paused is lost."""

from __future__ import annotations

import os

import pytest
import torch

from host_memory import open_memfds
from torch_mem_saver_lite import OutOfMemoryError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


@pytest.fixture
def small_saver():
    saver = HostSaver(capacity_bytes=64 * MiB)
    yield saver
    saver.close()


def test_resume_out_of_memory_rolls_back_keeps_backups_and_retry_succeeds(small_saver, mem):
    with small_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(16 * MiB), mem.malloc(16 * MiB)]
    contents = [os.urandom(16 * MiB) for _ in ptrs]
    for ptr, data in zip(ptrs, contents, strict=True):
        mem.write(ptr, data)
    small_saver.pause("weights")
    with small_saver.region("other"):
        other = mem.malloc(48 * MiB)  # leaves room for one of the two, not both
    memfds = open_memfds()

    with pytest.raises(OutOfMemoryError) as caught:
        small_saver.resume("weights")

    error = caught.value
    assert isinstance(error, torch.cuda.OutOfMemoryError)
    assert (error.tag, error.bytes_needed, error.bytes_free) == ("weights", 32 * MiB, 16 * MiB)
    assert "weights" in str(error) and "resume again" in str(error)
    stats = small_saver.stats()["weights"]
    assert (stats.resident_bytes, stats.paused_bytes, stats.host_backup_bytes) == (0, 32 * MiB, 32 * MiB)
    assert open_memfds() == memfds  # the one that fitted was rolled back

    mem.free(other)
    small_saver.resume("weights")
    for ptr, data in zip(ptrs, contents, strict=True):
        assert mem.read(ptr, len(data)) == data


def test_allocation_beyond_capacity_fails_cleanly(small_saver, mem):
    with small_saver.region("kv"):
        mem.malloc(60 * MiB)
        with pytest.raises(OutOfMemoryError, match="capacity"):
            mem.malloc(8 * MiB)
    assert small_saver.stats()["kv"].allocations == 1


def test_paused_context_raises_oom_on_exit_and_keeps_memory_paused(small_saver, mem):
    with small_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(32 * MiB)
    mem.write(ptr, b"precious")
    with pytest.raises(OutOfMemoryError):
        with small_saver.paused("kv"):
            with small_saver.region("train"):
                hog = mem.malloc(48 * MiB)
    assert small_saver.stats()["kv"].paused_bytes == 32 * MiB
    mem.free(hog)
    small_saver.resume("kv")
    assert mem.read(ptr, 8) == b"precious"
