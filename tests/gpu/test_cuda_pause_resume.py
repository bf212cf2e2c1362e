"""Pause/resume of real GPU memory in torch hook mode (marker gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cuda_evidence import device_free_bytes, mapped_range, pattern, unique_tag
from torch_mem_saver_lite import OutOfMemoryError, saver

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30

LAYOUTS = {"one_1GiB": [GiB], "4096x2MiB": [2 * MiB] * 4096}


@pytest.mark.parametrize("backup", [False, True], ids=["no_backup", "backup"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pause_returns_device_memory_and_resume_takes_it_back(layout, backup):
    tag = unique_tag(layout)
    outside = torch.full((1024,), 3.0, device="cuda")  # not in a region: never touched
    with saver.region(tag, enable_cpu_backup=backup):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in LAYOUTS[layout]]
    for seed, t in enumerate(tensors):
        t.copy_(pattern(t.numel(), seed))
    addresses = [t.data_ptr() for t in tensors]
    tensor_bytes = sum(t.numel() for t in tensors)
    reserved = saver.stats()[tag].reserved_bytes
    assert reserved >= tensor_bytes

    free_before = device_free_bytes()
    saver.pause(tag)
    free_paused = device_free_bytes()

    released = free_paused - free_before
    assert released >= 0.99 * tensor_bytes and released >= 0.99 * reserved, (released, reserved)
    assert saver.stats()[tag].resident_bytes == 0
    assert [t.data_ptr() for t in tensors] == addresses
    assert torch.equal(outside, torch.full_like(outside, 3.0))

    saver.resume(tag)
    assert free_paused - device_free_bytes() >= 0.99 * reserved
    assert [t.data_ptr() for t in tensors] == addresses
    assert all(mapped_range(p) is not None for p in addresses[:: max(1, len(addresses) // 64)])
    if backup:
        assert all(torch.equal(t, pattern(t.numel(), seed)) for seed, t in enumerate(tensors))
    else:
        for t in tensors:
            t.fill_(7)
        assert all(bool((t == 7).all()) for t in tensors)

    del tensors
    saver.pause(tag)  # the pool keeps its freed segments cached: give their memory back


def test_4096_saver_allocations_of_2MiB_pause_and_resume():
    """The core below torch's caching allocator: 4096 separate VMM allocations."""
    tag = unique_tag("raw2MiB")
    native = saver._core()
    ptrs = [native.malloc(2 * MiB, torch.cuda.current_device(), tag, False) for _ in range(4096)]
    try:
        free_before = device_free_bytes()
        native.pause([tag])
        assert device_free_bytes() - free_before >= 0.99 * 4096 * 2 * MiB
        native.resume([tag])
        assert free_before - device_free_bytes() <= 0.01 * 4096 * 2 * MiB
        assert all(mapped_range(p) == (p, 2 * MiB) for p in ptrs)
    finally:
        for p in ptrs:
            native.free(p)
    assert device_free_bytes() - free_before >= 0.99 * 4096 * 2 * MiB


def test_a_large_backup_resumed_in_pieces_keeps_its_address_and_bytes_and_graphs_replay():
    """A resume maps an allocation larger than a resume piece (256 MiB) in pieces: kernels and
    a graph captured before the first pause read and write across the piece edges."""
    tag = unique_tag("pieces")
    size = GiB + 2 * MiB  # four 256 MiB pieces and a short one
    with saver.region(tag, enable_cpu_backup=True):
        big = torch.empty(size, dtype=torch.uint8, device="cuda")
    big.copy_(pattern(size, 7))
    edges = torch.tensor([k * 256 * MiB - 1 for k in range(1, 5)], device="cuda")
    out = torch.zeros(8, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out[:4] = big[edges].long() + big[edges + 1].long() * 256  # both sides of each edge
        out[4] = big.sum(dtype=torch.int64)
    graph.replay()
    expected = out.clone()
    address = big.data_ptr()
    for _cycle in range(3):
        free_before = device_free_bytes()
        saver.pause(tag)
        assert device_free_bytes() - free_before >= 0.99 * size
        saver.resume(tag)
        assert free_before - device_free_bytes() <= 4 * MiB
        assert big.data_ptr() == address
        assert all(mapped_range(address + k * 256 * MiB) is not None for k in range(5))
        assert torch.equal(big, pattern(size, 7))
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)
    big[256 * MiB - 8: 256 * MiB + 8] = 1  # writable across an edge
    assert int(big[256 * MiB - 8: 256 * MiB + 8].sum()) == 16
    del big
    saver.pause(tag)


def test_cuda_graph_captured_before_pause_replays_after_resume():
    weights_tag, kv_tag = unique_tag("graph-weights"), unique_tag("graph-kv")
    with saver.region(weights_tag, enable_cpu_backup=True):
        weight = torch.randn(1024, 1024, device="cuda")
    with saver.region(kv_tag):
        kv = torch.zeros(16 * 1024, device="cuda")
    x = torch.randn(16, 1024, device="cuda")

    def step():
        out = x @ weight
        kv.add_(out.flatten())
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    kv.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    kv.zero_()
    graph.replay()
    expected = out.clone()
    torch.testing.assert_close(expected, x @ weight, rtol=1e-3, atol=1e-3)

    saver.pause([weights_tag, kv_tag])
    saver.resume([weights_tag, kv_tag])
    kv.zero_()  # no backup for the KV cache: refill
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()

    assert torch.equal(out, expected)
    assert torch.equal(kv, expected.flatten())


@pytest.mark.parametrize("backup", [False, True], ids=["no_backup", "backup"])
def test_resume_out_of_memory_keeps_everything_paused_and_a_retry_succeeds(backup):
    tag = unique_tag("oom")
    with saver.region(tag, enable_cpu_backup=backup):
        big = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    big.copy_(pattern(big.numel(), 11))
    reserved = saver.stats()[tag].reserved_bytes
    saver.pause(tag)
    torch.cuda.empty_cache()
    filler = torch.empty(device_free_bytes() - 2 * GiB, dtype=torch.uint8, device="cuda")

    with pytest.raises(OutOfMemoryError) as caught:
        saver.resume(tag)

    error = caught.value
    assert isinstance(error, torch.cuda.OutOfMemoryError)
    assert error.tag == tag and error.bytes_needed == reserved and error.bytes_free < reserved
    stats = saver.stats()[tag]
    assert (stats.resident_bytes, stats.paused_bytes) == (0, reserved)
    assert stats.host_backup_bytes == (reserved if backup else 0)

    del filler
    torch.cuda.empty_cache()
    saver.resume(tag)
    if backup:
        assert torch.equal(big, pattern(big.numel(), 11))
    else:
        big.fill_(1)
        assert int(big.sum()) == big.numel()
    del big
    saver.pause(tag)


def test_get_cpu_backup_of_a_paused_cuda_tensor():
    tag = unique_tag("cpu-backup")
    with saver.region(tag, enable_cpu_backup=True):
        t = torch.randn(256, 1024, device="cuda")
    expected = t.cpu()
    assert saver.get_cpu_backup(t) is None
    saver.pause(tag)
    assert torch.equal(saver.get_cpu_backup(t), expected)
    assert torch.equal(saver.get_cpu_backup(t[10:20]), expected[10:20])
    saver.resume(tag)
    assert torch.equal(t.cpu(), expected)
    del t
    saver.pause(tag)


def test_an_allocation_refused_by_the_margin_raises_torchs_error_with_the_reason():
    tag = unique_tag("margin")
    free, _total = torch.cuda.mem_get_info()
    saver.memory_margin_bytes = free - 256 * MiB  # at most 256 MiB may be taken
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
            with saver.region(tag):
                torch.empty(GiB, dtype=torch.uint8, device="cuda")
    finally:
        saver.memory_margin_bytes = 0
    cause = caught.value.__cause__
    assert isinstance(cause, OutOfMemoryError), repr(caught.value)
    assert cause.tag == tag and "memory margin" in str(cause), str(cause)


def test_process_exits_cleanly_while_memory_is_paused():
    code = textwrap.dedent(
        """
        import torch
        from torch_mem_saver_lite import saver
        with saver.region("weights", enable_cpu_backup=True):
            w = torch.randn(4096, 4096, device="cuda")
        with saver.region("kv"):
            kv = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = w @ w
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            y = w @ w
        saver.pause()
        print("paused", sum(v.paused_bytes for v in saver.stats().values()))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("paused ") and int(result.stdout.split()[1]) >= GiB
    assert "error" not in result.stderr.lower() and "abort" not in result.stderr.lower(), result.stderr


def test_cli_reports_the_gpu_ready():
    result = subprocess.run([sys.executable, "-m", "torch_mem_saver_lite"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "virtual memory management yes, granularity 2 MiB" in result.stdout
    assert "Ready" in result.stdout
    assert "GPU 0 breakdown: context" in result.stdout


def test_the_doctor_check_pauses_and_resumes_a_region_on_every_gpu():
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TMSL_TEST_HOOK_MODE")}
    result = subprocess.run([sys.executable, "-m", "torch_mem_saver_lite", "--check", "--json"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and len(report["checks"]) == torch.cuda.device_count()
    assert all(c["passed"] and c["released_bytes"] >= 0.99 * (64 << 20) for c in report["checks"])
    assert report["memory"] and report["memory"][0]["used_bytes"] > 0
    assert len(report["breakdown"]) == torch.cuda.device_count()
    for b in report["breakdown"]:  # the parts add up to what the device has in use
        parts = b["cuda_context"] + b["torch_reserved_outside_regions"] + b["nccl"] + b["saver_resident"] + b["unknown"]
        assert b["cuda_context"] > 0 and (parts == b["used"] or any("clamped" in n for n in b["notes"])), b
