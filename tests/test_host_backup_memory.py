"""Host memory of backups: given back after a non-retaining resume, and a pause that runs
out of host memory leaves everything resident with its content."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from host_memory import rss_anon_bytes

MiB = 1 << 20


def test_host_memory_returns_after_a_non_retaining_resume(host_saver, mem):
    host_saver.host_cache_bytes = 0  # no cache: every resume gives its backups back
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(32 * MiB) for _ in range(3)]
    for i, ptr in enumerate(ptrs):
        mem.write(ptr, bytes([i + 1]) * (32 * MiB))
    before = rss_anon_bytes()
    for _ in range(3):
        host_saver.pause("weights")
        assert rss_anon_bytes() - before >= 96 * MiB  # the backups are really in host memory
        host_saver.resume("weights")
        host_saver.wait_for_released_backups()
        assert rss_anon_bytes() - before < 8 * MiB, "backup memory was not given back"
    assert all(mem.read(p, 4) == bytes([i + 1]) * 4 for i, p in enumerate(ptrs))


@pytest.mark.parametrize("budget_mib", [96, 200])
def test_the_host_cache_keeps_backups_within_its_budget_and_gives_them_back(host_saver, mem, budget_mib):
    host_saver.host_cache_bytes = budget_mib * MiB
    with host_saver.region("weights", enable_cpu_backup=True):
        weights = [mem.malloc(32 * MiB) for _ in range(3)]
    with host_saver.region("optimizer", enable_cpu_backup=True):
        optimizer = [mem.malloc(32 * MiB) for _ in range(2)]
    for i, ptr in enumerate(weights + optimizer):
        mem.write(ptr, bytes([i + 1]) * (32 * MiB))
    before = rss_anon_bytes()
    for _ in range(3):
        host_saver.pause("weights")
        host_saver.resume("weights")  # 96 MiB: fits either budget
        host_saver.pause("optimizer")
        host_saver.resume("optimizer")  # 64 MiB more: fits only the larger one
        host_saver.wait_for_released_backups()
        kept = sum(host_saver.stats()[t].host_backup_bytes for t in ("weights", "optimizer"))
        assert kept == (96 if budget_mib == 96 else 160) * MiB
        assert kept <= host_saver.host_cache_bytes
        assert rss_anon_bytes() - before < kept + 8 * MiB  # host memory stays within the budget
    assert all(mem.read(p, 4) == bytes([i + 1]) * 4 for i, p in enumerate(weights + optimizer))
    host_saver.release_host_cache()
    assert sum(s.host_backup_bytes for s in host_saver.stats().values()) == 0
    assert rss_anon_bytes() - before < 8 * MiB, "release_host_cache did not give the memory back"


def test_pause_that_runs_out_of_host_memory_keeps_everything_resident():
    code = textwrap.dedent(
        """
        import resource
        from host_memory import HostMemory
        from torch_mem_saver_lite import OutOfMemoryError
        from torch_mem_saver_lite.testing import HostSaver
        mem, saver = HostMemory(), HostSaver()
        saver.host_cache_bytes = 0  # nothing set aside ahead: the pause itself needs the memory
        with saver.region("weights", enable_cpu_backup=True):
            ptrs = [mem.malloc(32 << 20) for _ in range(2)]
        for i, p in enumerate(ptrs):
            mem.write(p, bytes([7 + i]) * (32 << 20))
        saver.wait_for_released_backups()  # the background thread is idle: VmSize holds still
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))  # no room for 64 MiB
        try:
            saver.pause("weights")
        except OutOfMemoryError as e:
            print("oom:", "stays resident" in str(e))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        s = saver.stats()["weights"]
        print("state", s.resident_bytes, s.paused_bytes, s.host_backup_bytes)
        print("content", all(mem.read(p, 32 << 20) == bytes([7 + i]) * (32 << 20) for i, p in enumerate(ptrs)))
        saver.pause("weights")
        saver.resume("weights")
        print("retry", all(mem.read(p, 32 << 20) == bytes([7 + i]) * (32 << 20) for i, p in enumerate(ptrs)))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["oom: True", f"state {64 * MiB} 0 0", "content True", "retry True"]


def test_backups_larger_than_a_page_locked_range_and_at_odd_offsets_keep_their_content(host_saver, mem):
    # The host backend refuses a copy that crosses from one page-locked range into the next,
    # as CUDA does; every backup must therefore lie inside one range, whatever its size and
    # place in the arena (ranges hold 64 MiB of buffers; one buffer here is larger).
    sizes = [3 * MiB, 96 * MiB, 40 * MiB, 100 * MiB]
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(size) for size in sizes]
    for retain in (False, True):
        host_saver.retain_cpu_backup = retain
        for cycle in range(2):
            contents = [os.urandom(1 << 16) * (size >> 16) for size in sizes]
            for ptr, content in zip(ptrs, contents, strict=True):
                mem.write(ptr, content)
            host_saver.pause("weights")
            host_saver.resume("weights")
            for i, (ptr, content) in enumerate(zip(ptrs, contents, strict=True)):
                assert mem.read(ptr, sizes[i]) == content, f"retain={retain} cycle {cycle} buffer {i}"


def test_a_pause_whose_worker_threads_cannot_start_still_completes_and_settles():
    # The address space is capped just above what the process uses: room for the 4 MiB
    # backup, none for a worker thread's 8 MiB stack (as under a small pids or memory limit).
    code = textwrap.dedent(
        """
        import resource
        from host_memory import HostMemory
        from torch_mem_saver_lite.testing import HostSaver
        mem, saver = HostMemory(), HostSaver(granularity_bytes=1 << 20)
        saver.host_cache_bytes = 0
        with saver.region("weights", enable_cpu_backup=True):
            ptr = mem.malloc(3 << 20)
        mem.write(ptr, b"kept" * 1000)
        saver.wait_for_released_backups()  # the background thread is idle: VmSize holds still
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        limit = vm + (6 << 20)
        old = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
        import threading
        try:
            threading.Thread(target=lambda: None).start()
            print("threads still start")
        except RuntimeError:
            print("no thread can start")
        saver.pause("weights")
        stats = saver.stats()["weights"]
        print("paused", stats.paused_bytes == 3 << 20, stats.host_backup_bytes == 3 << 20)
        resource.setrlimit(resource.RLIMIT_AS, old)
        saver.resume("weights")
        print("content", mem.read(ptr, 4000) == b"kept" * 1000)
        mem.free(ptr)  # settled: a free does not wait forever
        print("freed", saver.stats()["weights"].allocations == 0)
        """
    )
    # host_memory comes from this directory, named explicitly (the working directory is not
    # on sys.path under PYTHONSAFEPATH, as in the wheel test).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                    os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(__file__), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:4] == ["no thread can start", "paused True True", "content True",
                                             "freed True"], result.stdout + result.stderr[-2000:]
