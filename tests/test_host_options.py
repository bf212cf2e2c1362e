"""disable(), memory_margin_bytes and retain_cpu_backup on the host backend."""

from __future__ import annotations

import os

import pytest

from torch_mem_saver_lite import OutOfMemoryError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def test_disable_takes_allocations_out_of_the_region_and_restores_it(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
        with host_saver.disable():
            # No ordinary allocator behind the host hook: refused, and not counted under "kv".
            with pytest.raises(Exception, match="outside saver.region"):
                mem.malloc(2 * MiB)
        mem.malloc(2 * MiB)
    assert host_saver.stats()["kv"].allocations == 2


def test_memory_margin_is_kept_on_allocation_and_on_resume(mem):
    saver = HostSaver(capacity_bytes=64 * MiB)
    try:
        saver.memory_margin_bytes = 16 * MiB
        with saver.region("kv"):
            with pytest.raises(OutOfMemoryError, match="margin"):
                mem.malloc(56 * MiB)
            mem.malloc(40 * MiB)
        saver.pause("kv")
        with saver.region("other"):
            other = mem.malloc(16 * MiB)
        with pytest.raises(OutOfMemoryError, match="margin"):
            saver.resume("kv")  # 40 MiB fit in the 48 free, but would leave 8 < 16
        mem.free(other)
        saver.resume("kv")
        with pytest.raises(ValueError):
            saver.memory_margin_bytes = -1
    finally:
        saver.close()


@pytest.mark.parametrize("retain", [False, True])
def test_retain_cpu_backup_keeps_host_memory_between_cycles_with_fresh_content(mem, retain):
    saver = HostSaver()
    try:
        saver.host_cache_bytes = 0  # retention alone decides here
        saver.retain_cpu_backup = retain
        with saver.region("weights", enable_cpu_backup=True):
            ptr = mem.malloc(4 * MiB)
        for _ in range(3):
            data = os.urandom(4 * MiB)  # new content each cycle: a stale backup would show
            mem.write(ptr, data)
            saver.pause("weights")
            saver.resume("weights")
            assert mem.read(ptr, len(data)) == data
            assert saver.stats()["weights"].host_backup_bytes == (4 * MiB if retain else 0)
    finally:
        saver.close()
