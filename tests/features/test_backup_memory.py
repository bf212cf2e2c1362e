"""CPU backups and their host memory: content kept bit for bit through cycles on every backend;
host memory given back after a non-retaining resume and kept within the host cache's budget;
a pause that runs out of host memory loses nothing; on a GPU, every workload through many
cycles, with and without retention."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from children import prelude, run_python
from cuda_evidence import unique_tag
from host_memory import rss_anon_bytes
from patterns import SCATTERED, pattern
from torch_mem_saver_lite import saver
from workloads import WORKLOADS, tensor_sizes

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("cache", ["uncached", "cached"])
def test_content_written_between_cycles_comes_back_after_every_one_of_five(backend, cache):
    """A backup kept in the host cache is refreshed by each pause, never resumed stale."""
    tag, sizes = backend.tag("weights"), [5 * MiB + 7, 2 * MiB, 4096]
    budget = backend.saver.host_cache_bytes
    backend.saver.host_cache_bytes = 0 if cache == "uncached" else 64 * MiB
    try:
        ptrs = [backend.allocate(tag, size, backup=True) for size in sizes]
        for cycle in range(5):
            contents = [os.urandom(size) for size in sizes]
            for ptr, data in zip(ptrs, contents, strict=True):
                backend.write(ptr, data)
            backend.saver.pause(tag)
            assert not any(backend.is_mapped(ptr) for ptr in ptrs)
            backend.saver.resume(tag)
            for ptr, data in zip(ptrs, contents, strict=True):
                assert backend.read(ptr, len(data)) == data, f"cycle {cycle}"
            kept = backend.saver.stats()[tag].host_backup_bytes
            assert (kept == 0) if cache == "uncached" else (kept > 0)
    finally:
        backend.saver.host_cache_bytes = budget


# Not over the stand-in driver: disk backup copies device memory through torch.cuda.
@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
def test_backups_the_node_budget_cannot_hold_go_to_disk_and_come_back_bit_exact(backend, disk_dir):
    """The disk tier (docs/guide.md, the node's host-memory budget): with 32 MiB of room, a
    pause of 48 + 16 MiB sends the 48 MiB allocation to a file and backs the rest up to host
    memory; the resume reads it back and removes the file."""
    saver_, tag = backend.saver, backend.tag("spill")
    big, small = backend.allocate(tag, 48 * MiB, backup=True), backend.allocate(tag, 16 * MiB, backup=True)
    contents = {big: os.urandom(48 * MiB), small: os.urandom(16 * MiB)}
    for ptr, data in contents.items():
        backend.write(ptr, data)
    tier = saver_.host_memory().disk_tier  # the process-wide saver's, put back at the end
    saver_.set_disk_backup_dir(disk_dir)
    saver_.release_host_cache()
    saver_.wait_for_released_backups()  # given back in the background: gone from the ledger now
    before = saver_.host_memory()
    budget = saver_.host_memory_budget
    # (The node's store counts too: chunks other allocations of the process hold, shared ahead
    # or kept since a resume, where it shares backups.)
    saver_.host_memory_budget = before.held_by_this_process + before.held_by_others + before.shared_bytes + 32 * MiB
    try:
        saver_.pause(tag)
        report = saver_.host_memory()
        assert report.spilled_bytes == 48 * MiB
        assert report.held_by_this_process - before.held_by_this_process == 16 * MiB
        assert len(list(disk_dir.glob("tmsl-*.bin"))) == 1
        assert not backend.is_mapped(big) and not backend.is_mapped(small)
        saver_.resume(tag)
    finally:
        saver_.host_memory_budget = budget
        saver_.set_disk_backup_dir(tier or None)
    assert all(backend.read(ptr, len(data)) == data for ptr, data in contents.items())
    assert list(disk_dir.glob("tmsl-*.bin")) == [] and saver_.host_memory().spilled_bytes == 0


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
    # Host memory set aside as the regions closed (within the budget) is in place first: a
    # preparation running later, while a tag is paused, would find room for the other tag.
    host_saver.wait_for_released_backups()
    before = rss_anon_bytes()
    for _ in range(3):
        host_saver.pause("weights")
        host_saver.resume("weights")  # 96 MiB: fits either budget
        host_saver.pause("optimizer")
        host_saver.resume("optimizer")  # 64 MiB more: fits only the larger one
        host_saver.wait_for_released_backups()
        kept = sum(host_saver.stats()[t].host_backup_bytes for t in ("weights", "optimizer"))
        # The smaller budget holds the newest copies (the optimizer's, in the weights' memory).
        assert kept == (64 if budget_mib == 96 else 160) * MiB
        assert kept <= host_saver.host_cache_bytes
        # Host memory stays within the budget (the newest copies may keep a larger arena whole).
        assert rss_anon_bytes() - before < min(host_saver.host_cache_bytes, 160 * MiB) + 8 * MiB
    assert all(mem.read(p, 4) == bytes([i + 1]) * 4 for i, p in enumerate(weights + optimizer))
    host_saver.release_host_cache()
    assert sum(s.host_backup_bytes for s in host_saver.stats().values()) == 0
    assert rss_anon_bytes() - before < 8 * MiB, "release_host_cache did not give the memory back"


def test_a_full_cache_hands_its_memory_to_a_pause_of_the_same_shape(host_saver, mem):
    # Room for one of two identically shaped tags: each pause takes the other's cached host
    # memory (prepared, page-locked) instead of fresh memory, so the cache always holds the
    # newest copy and no pause waits for memory to be faulted in.
    host_saver.host_cache_bytes = 80 * MiB
    ptrs = {}
    for tag in ("a", "b", "c"):
        with host_saver.region(tag, enable_cpu_backup=True):
            ptrs[tag] = [mem.malloc(64 * MiB)] if tag == "c" else [mem.malloc(32 * MiB), mem.malloc(32 * MiB)]
        host_saver.wait_for_released_backups()  # each region's memory set aside in turn: a's only (room for one)
    host_saver.pause("a")
    host_saver.resume("a")
    host_saver.wait_for_released_backups()
    for cycle in range(3):
        for tag in ("b", "a"):
            content = [bytes([cycle * 16 + ord(tag) + i]) * (32 * MiB) for i in range(2)]
            for ptr, data in zip(ptrs[tag], content, strict=True):
                mem.write(ptr, data)  # new content every cycle
            before = rss_anon_bytes()
            host_saver.pause(tag)
            assert rss_anon_bytes() - before < 8 * MiB  # the other tag's cached memory, not fresh
            host_saver.resume(tag)
            host_saver.wait_for_released_backups()
            assert [mem.read(p, 32 * MiB) for p in ptrs[tag]] == content
            stats = host_saver.stats()
            other = "a" if tag == "b" else "b"
            assert (stats[tag].host_backup_bytes, stats[other].host_backup_bytes) == (64 * MiB, 0)
    # Another shape of about the same size takes it too (carved anew), and the cache keeps
    # the newest copy (room for one).
    mem.write(ptrs["c"][0], b"c" * (64 * MiB))
    before = rss_anon_bytes()
    host_saver.pause("c")
    assert rss_anon_bytes() - before < 8 * MiB
    host_saver.resume("c")
    host_saver.wait_for_released_backups()
    assert mem.read(ptrs["c"][0], 64 * MiB) == b"c" * (64 * MiB)
    stats = host_saver.stats()
    assert (stats["a"].host_backup_bytes, stats["c"].host_backup_bytes) == (0, 64 * MiB)


def test_pause_that_runs_out_of_host_memory_keeps_everything_resident():
    code = prelude("import resource", "from torch_mem_saver_lite import OutOfMemoryError", body="""
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
        """)
    result = run_python(code)
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
    code = prelude("import resource", body="""
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
        """)
    # host_memory comes from tests/support/, named explicitly by the prelude (the working
    # directory is not on sys.path under PYTHONSAFEPATH, as in the wheel test).
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:4] == ["no thread can start", "paused True True", "content True",
                                             "freed True"], result.stdout + result.stderr[-2000:]


# On a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("keep", ["released", "cached", "retained"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_backup_content_identical_after_five_cycles(workload, keep):
    tag = unique_tag(workload)
    retain = keep == "retained"
    default_cache = saver.host_cache_bytes
    saver.retain_cpu_backup = retain
    saver.host_cache_bytes = 0 if keep == "released" else max(default_cache, 2 * GiB)
    try:
        with saver.region(tag, enable_cpu_backup=True):
            tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in tensor_sizes(workload, GiB)]
        rss_before = None
        for cycle in range(5):
            # New content every cycle: a stale (retained) backup would be caught.
            for i, t in enumerate(tensors):
                t.copy_(pattern(t.numel(), 1000 * cycle + i, device="cuda", **SCATTERED))
            saver.pause(tag)
            assert saver.stats()[tag].host_backup_bytes == saver.stats()[tag].reserved_bytes
            saver.resume(tag)
            for i, t in enumerate(tensors):
                assert torch.equal(t, pattern(t.numel(), 1000 * cycle + i, device="cuda", **SCATTERED)), \
                    f"cycle {cycle} tensor {i}"
            saver.wait_for_released_backups()
            # Measured from the end of the first cycle: the process's first pinned transfer
            # costs the CUDA driver some host memory of its own once.
            rss_before = rss_anon_bytes() if rss_before is None else rss_before
            grown = rss_anon_bytes() - rss_before
            if keep == "released":
                assert saver.stats()[tag].host_backup_bytes == 0
                assert grown < 32 * MiB, f"host memory not given back: +{grown / MiB:.0f} MiB"
            else:  # retained, or kept by the host cache (1 GiB fits its budget)
                assert saver.stats()[tag].host_backup_bytes == saver.stats()[tag].reserved_bytes
                assert grown < 32 * MiB, f"host memory grew beyond the kept backup: +{grown / MiB:.0f} MiB"
    finally:
        saver.retain_cpu_backup = False
        saver.host_cache_bytes = default_cache
    del tensors, t
    saver.empty_cache(tag)
    assert saver.stats()[tag].allocations == 0  # device memory and retained backups given back


@pytest.mark.gpu
def test_leaving_a_backed_up_region_sets_host_memory_aside_so_the_first_pause_takes_none():
    tag = unique_tag("set_aside")
    default_cache = saver.host_cache_bytes
    saver.host_cache_bytes = max(default_cache, 2 * GiB)
    saver.release_host_cache()  # room in the cache, whatever earlier tests left there
    torch.empty(1, device="cuda")  # the CUDA context's own host memory, before the baseline
    rss_start = rss_anon_bytes()
    try:
        with saver.region(tag, enable_cpu_backup=True):
            tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in tensor_sizes("weights", GiB)]
        saver.wait_for_released_backups()
        reserved = saver.stats()[tag].reserved_bytes
        assert saver.stats()[tag].host_backup_bytes == reserved  # set aside, without any pause
        for i, t in enumerate(tensors):
            t.copy_(pattern(t.numel(), i, device="cuda", **SCATTERED))
        # wait_for_released_backups returned once it was faulted in and page-locked
        assert rss_anon_bytes() - rss_start >= reserved, "the host memory set aside is not there"
        torch.cuda.synchronize()
        rss_before, free_before = rss_anon_bytes(), torch.cuda.mem_get_info()[0]
        saver.pause(tag)
        assert torch.cuda.mem_get_info()[0] - free_before >= 0.99 * reserved, "device memory not released"
        grown = rss_anon_bytes() - rss_before
        assert grown < 64 * MiB, f"the first pause took +{grown / MiB:.0f} MiB of new host memory"
        saver.resume(tag)
        for i, t in enumerate(tensors):
            assert torch.equal(t, pattern(t.numel(), i, device="cuda", **SCATTERED)), f"tensor {i}"
    finally:
        saver.host_cache_bytes = default_cache
    del tensors, t
    saver.empty_cache(tag)


@pytest.mark.gpu
def test_a_process_that_exits_while_host_memory_is_being_set_aside_exits_cleanly():
    # Its background threads may be inside the driver (page-locking) as the process ends.
    code = textwrap.dedent(
        """
        import torch
        from torch_mem_saver_lite import saver
        with saver.region("weights", enable_cpu_backup=True):
            w = torch.ones(4 << 30, dtype=torch.uint8, device="cuda")
        print("exiting")
        """
    )
    for _ in range(3):
        result = run_python(code)
        assert (result.returncode, result.stdout) == (0, "exiting\n"), result.stderr[-3000:]


@pytest.mark.gpu
def test_zero_copy_backup_is_page_locked_and_copies_to_the_gpu_in_one_piece():
    # A 200 MiB tensor after a smaller segment: its backup is page-locked in several ranges
    # while the pause copies, and must be one registration once leased, or this one torch
    # copy fails with "invalid argument". The second cycle reuses the cached backups.
    tag = unique_tag("zero_copy")
    with saver.region(tag, enable_cpu_backup=True):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3 * MiB, 200 * MiB)]
    for cycle in range(2):
        for seed, t in enumerate(tensors):
            t.copy_(pattern(t.numel(), seed + 10 * cycle, device="cuda", **SCATTERED))
        saver.pause(tag)
        try:
            for seed, t in enumerate(tensors):
                host = saver.get_cpu_backup(t, zero_copy=True)
                assert host.is_pinned()
                on_gpu = torch.empty_like(t)  # outside the region: resident while it is paused
                on_gpu.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                assert torch.equal(on_gpu, pattern(t.numel(), seed + 10 * cycle, device="cuda", **SCATTERED))
        finally:
            saver.resume(tag)
        for seed, t in enumerate(tensors):
            assert torch.equal(t, pattern(t.numel(), seed + 10 * cycle, device="cuda", **SCATTERED))
    del tensors, t, host, on_gpu
    saver.empty_cache(tag)


@pytest.mark.gpu
def test_pause_interrupted_by_host_memory_exhaustion_loses_nothing():
    code = textwrap.dedent(
        """
        import resource, torch
        from torch_mem_saver_lite import saver, OutOfMemoryError
        saver.host_cache_bytes = 0  # nothing set aside ahead: the pause itself needs the memory
        with saver.region("weights", enable_cpu_backup=True):
            w = torch.full((1 << 30,), 7, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        saver.wait_for_released_backups()  # the background thread is idle: VmSize holds still
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), hard))
        try:
            saver.pause("weights")
            print("paused anyway")
        except OutOfMemoryError as e:
            print("oom", "stays resident" in str(e))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        s = saver.stats()["weights"]
        print("state", s.resident_bytes == s.reserved_bytes, s.paused_bytes, s.host_backup_bytes)
        print("content", int((w == 7).sum()) == w.numel())
        saver.pause("weights"); saver.resume("weights")
        print("retry", int((w == 7).sum()) == w.numel())
        """
    )
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["oom True", "state True 0 0", "content True", "retry True"], result.stdout
