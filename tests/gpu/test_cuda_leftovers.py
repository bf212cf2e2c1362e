"""release_leftovers and memory_breakdown on a real GPU (marker gpu): the breakdown adds up
and agrees with the driver; the caching allocator's free blocks (torch's and idle saver
pools') really leave the device; NCCL process groups of one and two ranks are suspended
around a pause (or the report says why not) and their collectives are correct afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_evidence import device_free_bytes, pattern, unique_tag
from torch_mem_saver_lite import saver

pytestmark = pytest.mark.gpu
MiB = 1 << 20
# Figures read at slightly different moments (cudaMemGetInfo, then torch's counters): the
# driver may take or give a page table or two meanwhile.
TOLERANCE = 8 * MiB


def parts(b) -> int:
    return b.cuda_context + b.torch_reserved_outside_regions + b.nccl + b.saver_resident + b.unknown


def test_the_breakdown_adds_up_and_agrees_with_the_driver():
    tag = unique_tag("breakdown")
    outside = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    with saver.region(tag):
        inside = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    b = saver.memory_breakdown()
    free, total = torch.cuda.mem_get_info()
    assert b.device == torch.cuda.current_device() and b.total == total
    assert abs(b.used - (total - free)) <= TOLERANCE, (b, free)
    assert abs(device_free_bytes() - (total - b.used)) <= TOLERANCE  # cuda-python's view agrees
    if any("clamped" in n for n in b.notes):  # the known parts exceeded what is used: unknown is 0
        assert b.unknown == 0 and parts(b) >= b.used, b
    else:  # unknown is the remainder (0 when the known parts account for everything)
        assert b.unknown >= 0 and parts(b) == b.used, b
    assert b.cuda_context > 0, b
    assert b.saver_resident >= 256 * MiB and b.torch_reserved_outside_regions >= 128 * MiB, b

    saver.pause(tag)
    p = saver.memory_breakdown()
    assert b.saver_resident - p.saver_resident >= 0.99 * 256 * MiB, (b, p)
    assert p.saver_paused - b.saver_paused >= 0.99 * 256 * MiB, (b, p)
    assert b.used - p.used >= 0.99 * 256 * MiB, (b, p)  # the device agrees that it left
    assert abs(p.torch_reserved_outside_regions - b.torch_reserved_outside_regions) <= TOLERANCE
    assert "GPU" in str(p) and "cuda context" in str(p)
    saver.resume(tag)
    del inside, outside
    saver.empty_cache(tag)


def test_bad_devices_are_refused():
    for bad, error in (("cpu", ValueError), (torch.cuda.device_count(), ValueError), (1.5, TypeError),
                       (True, TypeError), ("gpu7", ValueError)):
        with pytest.raises(error):
            saver.memory_breakdown(bad)


def test_release_leftovers_gives_torchs_cached_free_blocks_back():
    scratch = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    scratch.fill_(1)
    del scratch  # now a cached free block of torch's allocator
    reserved = torch.cuda.memory_reserved()
    free_before = device_free_bytes()
    report = saver.release_leftovers()
    released = device_free_bytes() - free_before
    assert released >= 0.99 * 512 * MiB, (released, report)
    assert report.torch_cache_bytes >= 512 * MiB and reserved - torch.cuda.memory_reserved() >= 512 * MiB
    assert report.breakdown is not None and report.breakdown.device == torch.cuda.current_device()


def test_release_leftovers_can_free_a_segment_that_a_cublas_workspace_landed_in():
    # The first matmul on a stream makes torch allocate that stream's cuBLAS workspace; here it
    # is cut out of a freed 1 GiB block, so empty_cache alone cannot give the segment back.
    saver.release_leftovers()
    reserved0 = torch.cuda.memory_reserved()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del big
        a = torch.randn(256, 256, device="cuda")
        (a @ a).sum().item()
    del a
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - reserved0 >= 1 << 30, "the workspace did not pin the segment"
    saver.release_leftovers()  # by default the workspaces stay, and with them the segment
    assert torch.cuda.memory_reserved() - reserved0 >= 1 << 30
    free_before = device_free_bytes()
    report = saver.release_leftovers(cublas_workspaces=True)
    assert torch.cuda.memory_reserved() - reserved0 < 64 * MiB
    assert device_free_bytes() - free_before >= (1 << 30) - TOLERANCE
    assert report.torch_cache_bytes >= (1 << 30) - TOLERANCE
    a = torch.randn(256, 256, device="cuda")
    assert torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3)  # cuBLAS works after


def test_release_leftovers_gives_back_what_an_idle_saver_pool_caches_and_keeps_live_tensors():
    tag = unique_tag("idle-pool")
    with saver.region(tag, enable_cpu_backup=True):
        kept = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        gone = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    kept.copy_(pattern(kept.numel(), 5))
    gone.fill_(3)
    del gone  # cached in the tag's pool: still resident, still the tag's
    free_before = device_free_bytes()
    report = saver.release_leftovers()
    released = device_free_bytes() - free_before
    assert report.saver_pool_cache_bytes >= 256 * MiB, report
    assert released >= 0.99 * 256 * MiB, (released, report)
    assert torch.equal(kept, pattern(kept.numel(), 5))
    # The live tensor is still the tag's: a pause covers it, and the tag's regions go on.
    free_before = device_free_bytes()
    saver.pause(tag)
    assert device_free_bytes() - free_before >= 0.99 * 64 * MiB
    saver.resume(tag)
    assert torch.equal(kept, pattern(kept.numel(), 5))
    with saver.region(tag):
        more = torch.ones(MiB, device="cuda")
    assert float(more.sum()) == MiB
    del kept, more
    saver.empty_cache(tag)


def test_release_leftovers_keeps_a_pool_a_captured_graph_uses():
    tag = unique_tag("graph-pool")
    static = torch.ones(MiB, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag=tag):
        out = static * 2
    report = saver.release_leftovers()
    assert any(tag in note for note in report.notes), report.notes
    graph.replay()
    assert float(out.sum()) == 2 * MiB
    del graph, out
    saver.empty_cache(tag)


def run_ranks(nproc: int, port: int) -> list[dict]:
    worker = Path(__file__).with_name("nccl_leftovers_worker.py")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                             "--master-port", str(port), str(worker)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The ranks print to one pipe, so their lines may run into each other: match, not split.
    rows = [dict(rank=rank, suspended=suspended, released=released) for rank, suspended, released in
            re.findall(r"rank ok rank=(\d+) suspended=(True|False) released=(\d+)", result.stdout)]
    assert len(rows) == nproc, result.stdout
    print(result.stdout)
    return rows


def check_ranks(rows: list[dict]) -> None:
    # Suspending is collective: every rank did the same with each group.
    assert len({r["suspended"] for r in rows}) == 1, rows
    if os.environ.get("TMSL_EXPECT_NCCL_SUSPEND") == "1":  # set where torch or NCCL can suspend
        assert all(r["suspended"] == "True" for r in rows), rows


def test_one_rank_nccl_group_is_suspended_around_a_pause_and_works_after():
    check_ranks(run_ranks(1, 29531))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_nccl_groups_are_suspended_around_a_pause_and_work_after():
    check_ranks(run_ranks(2, 29533))
