"""Pause/resume semantics: the promises every backend keeps (the `backend` fixture: host,
stand-in driver, GPU), then what only the host backend or only a real GPU can show."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import backends
import pytest
import torch

from children import run_python
from cuda_evidence import device_free_bytes, mapped_range, unique_tag
from host_memory import open_memfds, resident_pages
from patterns import SCATTERED, pattern
from torch_mem_saver_lite import OutOfMemoryError, saver

MiB, GiB = 1 << 20, 1 << 30
PAGE = 4096


def test_pause_releases_the_memory_and_resume_maps_fresh_memory_at_the_same_address(backend):
    size, tag = 32 * MiB, backend.tag("kv")
    ptr = backend.allocate(tag, size)
    backend.write(ptr, b"\xab" * size)
    held = backend.held_bytes()

    backend.saver.pause(tag)

    held_paused = backend.held_bytes()
    assert held - held_paused >= size
    # The address stays reserved; without a backup, the scratch answers there (stray_access).
    assert backend.is_mapped(ptr) == backends.discarded_stays_mapped(backend)
    stats = backend.saver.stats()[tag]
    assert (stats.resident_bytes, stats.paused_bytes, stats.host_backup_bytes) == (0, stats.reserved_bytes, 0)

    backend.saver.resume(tag)

    assert backend.is_mapped(ptr)
    backend.write(ptr, b"\x01" * size)  # fresh memory, writable at its old address
    assert backend.read(ptr, size) == b"\x01" * size
    assert backend.held_bytes() - held_paused >= size  # (host pages count once written)
    assert backend.saver.stats()[tag].resident_bytes == stats.reserved_bytes


def test_backup_keeps_content_bit_for_bit(backend):
    sizes, tag = [8 * MiB, 3 * MiB + 123, 1], backend.tag("weights")
    ptrs = [backend.allocate(tag, size, backup=True) for size in sizes]
    contents = [os.urandom(size) for size in sizes]
    for ptr, data in zip(ptrs, contents, strict=True):
        backend.write(ptr, data)
    held = backend.held_bytes()

    backend.saver.pause(tag)

    reserved, backed_up = backend.saver.stats()[tag].reserved_bytes, backend.saver.stats()[tag].host_backup_bytes
    assert held - backend.held_bytes() >= sum(sizes)
    # Exact size: the bytes asked for, to whole pages, not the granules reserved.
    assert backed_up == sum(-(-size // PAGE) * PAGE for size in sizes) if backend.exact_sizes else \
        sum(sizes) <= backed_up <= reserved
    assert not any(backend.is_mapped(ptr) for ptr in ptrs)

    backend.saver.resume(tag)

    for ptr, data in zip(ptrs, contents, strict=True):
        assert backend.read(ptr, len(data)) == data
    # Kept for the next pause when the host cache has room for it, else released.
    assert backend.saver.stats()[tag].host_backup_bytes in (0, backed_up)


def test_pause_selects_tags(backend):
    a, b = backend.tag("a"), backend.tag("b")
    backend.allocate(a, 4 * MiB)
    kept = backend.allocate(b, 4 * MiB)
    backend.write(kept, b"keep")

    backend.saver.pause(a)
    stats = backend.saver.stats()
    assert stats[a].paused_bytes == stats[a].reserved_bytes > 0 and stats[b].paused_bytes == 0
    assert backend.is_mapped(kept) and backend.read(kept, 4) == b"keep"

    backend.saver.pause([a, b])
    assert backend.saver.stats()[b].resident_bytes == 0
    assert backend.is_mapped(kept) == backends.discarded_stays_mapped(backend)
    backend.saver.resume([b])
    stats = backend.saver.stats()
    assert stats[a].resident_bytes == 0 and stats[b].resident_bytes == stats[b].reserved_bytes
    backend.saver.resume([a, b])
    assert backend.saver.stats()[a].paused_bytes == 0


def test_on_the_host_backend_a_pause_closes_the_memfd_and_resumed_memory_is_zero(host_saver, mem):
    size = 32 * MiB
    host_saver.stray_access = "off"  # the range unmapped while paused (the scratch's own: test_stray_access.py)
    with host_saver.region("kv"):
        ptr = mem.malloc(size)
    mem.write(ptr, b"\xab" * size)
    memfds_before = open_memfds()
    assert resident_pages(ptr, size) == size // 4096

    host_saver.pause("kv")
    assert open_memfds() == memfds_before - 1  # the physical memory itself is gone
    assert resident_pages(ptr, size) == 0

    host_saver.resume("kv")
    assert mem.read(ptr, size) == bytes(size)


def test_double_pause_and_double_resume_are_noops(host_saver, mem):
    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"data")
    host_saver.pause("kv")
    first = host_saver.stats()
    host_saver.pause("kv")
    assert host_saver.stats() == first  # backups not taken again from unmapped memory
    host_saver.resume("kv")
    host_saver.resume("kv")
    assert mem.read(ptr, 4) == b"data"


def test_stats_carry_the_last_pause_and_resume_time_of_each_tag(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(16 * MiB)
    with host_saver.region("weights", enable_cpu_backup=True):
        mem.malloc(8 * MiB)
    with host_saver.region("empty"):
        pass
    # The host memory set aside in the background for "weights" (its region closed) given back
    # once that work has run: the figures below are the same at the end, whenever it ran.
    host_saver.release_host_cache()
    before = host_saver.stats()
    assert all(s.last_pause_seconds is None and s.last_resume_seconds is None for s in before.values())

    host_saver.pause(["kv", "empty"])
    kv = host_saver.stats()["kv"]
    assert kv.last_pause_seconds is not None and kv.last_pause_seconds > 0
    assert kv.last_resume_seconds is None
    assert host_saver.stats()["weights"].last_pause_seconds is None  # not covered
    assert host_saver.stats()["empty"].last_pause_seconds is None  # covered, nothing released

    host_saver.pause()  # releases only "weights" now: "kv"'s figure is the call that released it
    after = host_saver.stats()
    assert after["kv"].last_pause_seconds == kv.last_pause_seconds
    assert after["weights"].last_pause_seconds is not None and after["weights"].last_pause_seconds > 0

    host_saver.resume()
    host_saver.release_host_cache()  # backups kept for the next pause would differ too
    resumed = host_saver.stats()
    assert resumed["kv"].last_resume_seconds == resumed["weights"].last_resume_seconds > 0  # one call
    assert resumed == before  # timings are history, not state: equality ignores them


def test_free_of_paused_allocation_releases_everything(host_saver, mem):
    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(8 * MiB)
    host_saver.pause("kv")
    assert host_saver.stats()["kv"].host_backup_bytes > 0

    mem.free(ptr)

    stats = host_saver.stats()["kv"]
    assert (stats.allocations, stats.reserved_bytes, stats.resident_bytes, stats.paused_bytes,
            stats.host_backup_bytes) == (0, 0, 0, 0, 0)
    assert stats.paused  # the tag itself stays paused until resumed
    assert resident_pages(ptr, 8 * MiB) is None  # the address range itself is returned


def test_allocations_are_rounded_to_the_granularity(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(1)
        mem.malloc(2 * MiB + 1)
    assert host_saver.stats()["kv"].reserved_bytes == 2 * MiB + 4 * MiB


def test_paused_context_manager_resumes_when_the_body_raises(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
    with pytest.raises(KeyError):
        with host_saver.paused("kv"):
            assert host_saver.stats()["kv"].paused_bytes == 2 * MiB
            raise KeyError("train step failed")
    assert host_saver.stats()["kv"].resident_bytes == 2 * MiB


def test_regions_nest_and_restore_the_outer_tag(host_saver, mem):
    with host_saver.region("outer"):
        mem.malloc(2 * MiB)
        with host_saver.region("inner"):
            mem.malloc(4 * MiB)
        mem.malloc(2 * MiB)
    stats = host_saver.stats()
    assert stats["outer"].reserved_bytes == 4 * MiB and stats["inner"].reserved_bytes == 4 * MiB
    with pytest.raises(Exception, match="outside saver.region"):
        mem.malloc(2 * MiB)  # out of every region: the hook refuses, nothing is allocated


def test_get_cpu_backup_returns_the_host_copy_while_paused(host_saver, mem):
    import ctypes

    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    tensor = torch.frombuffer((ctypes.c_uint8 * (4 * MiB)).from_address(ptr), dtype=torch.float32)
    tensor.copy_(torch.randn(tensor.numel()))
    expected = tensor.clone()
    assert host_saver.get_cpu_backup(tensor) is None  # resident: no host copy exists

    host_saver.pause("weights")
    backup = host_saver.get_cpu_backup(tensor)
    view = host_saver.get_cpu_backup(tensor[1024:2048], zero_copy=True)

    assert torch.equal(backup, expected)
    assert torch.equal(view, expected[1024:2048])
    host_saver.resume("weights")
    assert torch.equal(tensor, expected)


def test_a_backup_larger_than_a_page_locked_range_round_trips_in_parts_and_leases_whole(host_saver, mem):
    import ctypes

    # 150 MiB is page-locked in three ranges while the pause copies (the host backend, like
    # CUDA, refuses a copy that crosses from one registration into the next); a lease makes
    # it one registration, and later cycles copy through that.
    sizes = [3 * MiB, 150 * MiB, 5 * MiB]
    with host_saver.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(n) for n in sizes]
    tensors = [torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
               for p, n in zip(ptrs, sizes, strict=True)]
    for cycle in range(3):
        expected = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        for t, e in zip(tensors, expected, strict=True):
            t.copy_(e)
        host_saver.pause("weights")
        if cycle > 0:  # the first cycle copies back in parts, never leased
            leased = host_saver.get_cpu_backup(tensors[1], zero_copy=True)
            assert torch.equal(leased, expected[1])
            del leased
        host_saver.resume("weights")
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True)), f"cycle {cycle}"


def test_get_cpu_backup_rejects_what_it_cannot_serve(host_saver, mem):
    import ctypes

    with host_saver.region("kv"):
        ptr = mem.malloc(2 * MiB)
    in_region = torch.frombuffer((ctypes.c_uint8 * (2 * MiB)).from_address(ptr), dtype=torch.uint8)
    with pytest.raises(ValueError, match="enable_cpu_backup=True"):
        host_saver.get_cpu_backup(in_region)
    with pytest.raises(ValueError, match="not allocated inside a region"):
        host_saver.get_cpu_backup(torch.zeros(16))
    with pytest.raises(ValueError, match="contiguous"):
        host_saver.get_cpu_backup(in_region.view(1024, -1).t())
    with pytest.raises(TypeError):
        host_saver.get_cpu_backup(b"bytes")


def test_an_exact_size_backup_restores_the_bytes_asked_for_and_poisons_the_rest_of_the_granule(host_saver, mem):
    import ctypes

    size = 3 * MiB + 123  # reserves 4 MiB; the backup holds 3 MiB + one page
    kept = -(-size // PAGE) * PAGE
    host_saver.poison_on_resume = True
    with host_saver.region("w", enable_cpu_backup=True):
        ptr = mem.malloc(size)
    data = os.urandom(size)
    mem.write(ptr, data)
    mem.write(ptr + size, b"\x11" * (4 * MiB - size))  # past the request: never the caller's
    host_saver.pause("w")
    assert host_saver.stats()["w"].host_backup_bytes == kept
    host_saver.resume("w")
    assert mem.read(ptr, size) == data
    assert mem.read(ptr + kept, 4 * MiB - kept) == b"\xff" * (4 * MiB - kept)  # poisoned, not restored
    # get_cpu_backup serves the backed-up bytes and refuses a range that runs past them.
    host_saver.pause("w")
    inside = torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)
    assert bytes(host_saver.get_cpu_backup(inside).numpy()) == data
    beyond = torch.frombuffer((ctypes.c_uint8 * (kept + PAGE)).from_address(ptr), dtype=torch.uint8)
    with pytest.raises(ValueError, match="backed up"):
        host_saver.get_cpu_backup(beyond)
    host_saver.resume("w")


# On a GPU

LAYOUTS = {"one_1GiB": [GiB], "4096x2MiB": [2 * MiB] * 4096}


@pytest.mark.gpu
@pytest.mark.parametrize("backup", [False, True], ids=["no_backup", "backup"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pause_returns_device_memory_and_resume_takes_it_back(layout, backup):
    tag = unique_tag(layout)
    outside = torch.full((1024,), 3.0, device="cuda")  # not in a region: never touched
    with saver.region(tag, enable_cpu_backup=backup):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in LAYOUTS[layout]]
    for seed, t in enumerate(tensors):
        t.copy_(pattern(t.numel(), seed, device="cuda", **SCATTERED))
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
        assert all(torch.equal(t, pattern(t.numel(), seed, device="cuda", **SCATTERED))
                   for seed, t in enumerate(tensors))
    else:
        for t in tensors:
            t.fill_(7)
        assert all(bool((t == 7).all()) for t in tensors)

    del tensors
    saver.pause(tag)  # the pool keeps its freed segments cached: give their memory back


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_a_large_backup_resumed_in_pieces_keeps_its_address_and_bytes_and_graphs_replay():
    """A resume maps an allocation larger than a resume piece (256 MiB) in pieces: kernels and
    a graph captured before the first pause read and write across the piece edges."""
    tag = unique_tag("pieces")
    size = GiB + 2 * MiB  # four 256 MiB pieces and a short one
    with saver.region(tag, enable_cpu_backup=True):
        big = torch.empty(size, dtype=torch.uint8, device="cuda")
    big.copy_(pattern(size, 7, device="cuda", **SCATTERED))
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
        assert torch.equal(big, pattern(size, 7, device="cuda", **SCATTERED))
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)
    big[256 * MiB - 8: 256 * MiB + 8] = 1  # writable across an edge
    assert int(big[256 * MiB - 8: 256 * MiB + 8].sum()) == 16
    del big
    saver.pause(tag)


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("backup", [False, True], ids=["no_backup", "backup"])
def test_resume_out_of_memory_keeps_everything_paused_and_a_retry_succeeds(backup):
    tag = unique_tag("oom")
    with saver.region(tag, enable_cpu_backup=backup):
        big = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    big.copy_(pattern(big.numel(), 11, device="cuda", **SCATTERED))
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
        assert torch.equal(big, pattern(big.numel(), 11, device="cuda", **SCATTERED))
    else:
        big.fill_(1)
        assert int(big.sum()) == big.numel()
    del big
    saver.pause(tag)


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("paused ") and int(result.stdout.split()[1]) >= GiB
    assert "error" not in result.stderr.lower() and "abort" not in result.stderr.lower(), result.stderr


@pytest.mark.gpu
def test_cli_reports_the_gpu_ready():
    result = subprocess.run([sys.executable, "-m", "torch_mem_saver_lite"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "virtual memory management yes, granularity 2 MiB" in result.stdout
    assert "Ready" in result.stdout
    assert "GPU 0 breakdown: context" in result.stdout


@pytest.mark.gpu
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
        parts = (b["cuda_context"] + b["torch_reserved_outside_regions"] + b["nccl"] + b["saver_resident"]
                 + b["saver_scratch"] + b["unknown"])
        assert b["cuda_context"] > 0 and (parts == b["used"] or any("clamped" in n for n in b["notes"])), b
