"""CPU backup on the GPU: content kept through many cycles for every workload, with and
without retention; host memory given back; an interrupted pause loses nothing (marker gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.workloads import WORKLOADS, tensor_sizes

from cuda_evidence import pattern, unique_tag
from host_memory import rss_anon_bytes
from torch_mem_saver_lite import saver

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30


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
                t.copy_(pattern(t.numel(), 1000 * cycle + i))
            saver.pause(tag)
            assert saver.stats()[tag].host_backup_bytes == saver.stats()[tag].reserved_bytes
            saver.resume(tag)
            for i, t in enumerate(tensors):
                assert torch.equal(t, pattern(t.numel(), 1000 * cycle + i)), f"cycle {cycle} tensor {i}"
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
            t.copy_(pattern(t.numel(), i))
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
            assert torch.equal(t, pattern(t.numel(), i)), f"tensor {i}"
    finally:
        saver.host_cache_bytes = default_cache
    del tensors, t
    saver.empty_cache(tag)


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
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ))
        assert (result.returncode, result.stdout) == (0, "exiting\n"), result.stderr[-3000:]


def test_zero_copy_backup_is_page_locked_and_copies_to_the_gpu_in_one_piece():
    # A 200 MiB tensor after a smaller segment: its backup is page-locked in several ranges
    # while the pause copies, and must be one registration once leased, or this one torch
    # copy fails with "invalid argument". The second cycle reuses the cached backups.
    tag = unique_tag("zero_copy")
    with saver.region(tag, enable_cpu_backup=True):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3 * MiB, 200 * MiB)]
    for cycle in range(2):
        for seed, t in enumerate(tensors):
            t.copy_(pattern(t.numel(), seed + 10 * cycle))
        saver.pause(tag)
        try:
            for seed, t in enumerate(tensors):
                host = saver.get_cpu_backup(t, zero_copy=True)
                assert host.is_pinned()
                on_gpu = torch.empty_like(t)  # outside the region: resident while it is paused
                on_gpu.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                assert torch.equal(on_gpu, pattern(t.numel(), seed + 10 * cycle))
        finally:
            saver.resume(tag)
        for seed, t in enumerate(tensors):
            assert torch.equal(t, pattern(t.numel(), seed + 10 * cycle))
    del tensors, t, host, on_gpu
    saver.empty_cache(tag)


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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["oom True", "state True 0 0", "content True", "retry True"], result.stdout
