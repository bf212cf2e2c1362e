"""1,000 pause/resume cycles on the host backend: host memory, open file descriptors and
the allocation table do not grow (the fast CI variant of tests/soaks/soak_gpu.py)."""

from __future__ import annotations

import os

import pytest

from host_memory import open_memfds, rss_anon_bytes, rss_shmem_bytes
from torch_mem_saver_lite.testing import HostSaver

KiB = 1 << 10


@pytest.mark.parametrize("backup", [False, True], ids=["no_backup", "backup"])
def test_a_thousand_cycles_leave_no_growth(mem, backup):
    saver = HostSaver(granularity_bytes=64 * KiB)
    try:
        with saver.region("kv", enable_cpu_backup=backup):
            ptrs = [mem.malloc(256 * KiB) for _ in range(4)]
        for i, p in enumerate(ptrs):
            mem.write(p, bytes([i + 1]) * (256 * KiB))

        def snapshot():
            saver.wait_for_released_backups()
            return dict(anon=rss_anon_bytes(), shmem=rss_shmem_bytes(), memfds=open_memfds(),
                        fds=len(os.listdir("/proc/self/fd")), stats=saver.stats()["kv"])

        for _ in range(10):  # warm-up: allocator arenas and the like settle
            saver.pause("kv")
            saver.resume("kv")
        start = snapshot()
        for _ in range(1000):
            saver.pause("kv")
            saver.resume("kv")
        end = snapshot()

        assert end["stats"] == start["stats"] and end["stats"].allocations == 4
        assert (end["memfds"], end["fds"]) == (start["memfds"], start["fds"])
        assert end["anon"] - start["anon"] < 4 << 20, (start, end)
        assert end["shmem"] - start["shmem"] < 1 << 20
        if backup:
            assert all(mem.read(p, 16) == bytes([i + 1]) * 16 for i, p in enumerate(ptrs))
    finally:
        saver.close()
