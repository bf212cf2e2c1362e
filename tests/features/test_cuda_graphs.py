"""Pauseable CUDA graph pools, nested regions, disable() and expandable segments (marker gpu)."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from children import run_python
from cuda_evidence import device_free_bytes, unique_tag
from torch_mem_saver_lite import saver

pytestmark = pytest.mark.gpu
MiB = 1 << 20
BATCH_SIZES = [8, 4, 2, 1]  # captured largest first, sharing one pool


class TinyDecoder:
    """A decode-like step: embedding, projection, a KV-cache write and read, logits."""

    def __init__(self, weights_tag: str, kv_tag: str, dim: int = 1024, vocab: int = 4096):
        gen = torch.Generator(device="cuda").manual_seed(0)
        with saver.region(weights_tag, enable_cpu_backup=True):
            self.emb = torch.randn(vocab, dim, device="cuda", generator=gen)
            self.w1 = torch.randn(dim, dim, device="cuda", generator=gen) / dim**0.5
            self.w2 = torch.randn(dim, vocab, device="cuda", generator=gen) / dim**0.5
        with saver.region(kv_tag):
            self.kv = torch.zeros(64, dim, device="cuda")

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        h = torch.tanh(self.emb[tokens] @ self.w1)
        self.kv[:b] = h
        scores = (self.kv[:b] * h).sum(-1, keepdim=True)
        return h @ self.w2 + scores


def test_graphs_for_four_batch_sizes_pause_with_weights_and_kv_and_replay_bit_identical():
    weights_tag, kv_tag, graph_tag = (unique_tag(t) for t in ("weights", "kv", "cuda_graph"))
    saver.release_host_cache()  # room in the cache, whatever earlier tests left there
    model = TinyDecoder(weights_tag, kv_tag)
    inputs = {b: torch.randint(0, 4096, (b,), device="cuda") for b in BATCH_SIZES}

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in BATCH_SIZES:
            model.step(inputs[b])  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graphs, outputs = {}, {}
    for b in BATCH_SIZES:
        graphs[b] = torch.cuda.CUDAGraph()
        with saver.cuda_graph(graphs[b], tag=graph_tag):
            outputs[b] = model.step(inputs[b])
    eager = {b: model.step(inputs[b]).clone() for b in BATCH_SIZES}
    for b in BATCH_SIZES:
        graphs[b].replay()
        assert torch.equal(outputs[b], eager[b]), f"graph and eager differ before pausing (b={b})"

    tags = [weights_tag, kv_tag, graph_tag]
    saver.wait_for_released_backups()  # host memory for the backups, set aside as the regions closed
    stats = saver.stats()
    assert stats[graph_tag].reserved_bytes > 0, "the graph pool's memory is not under the saver"
    assert [stats[t].host_backup_bytes for t in tags] == [stats[weights_tag].reserved_bytes, 0,
                                                          stats[graph_tag].reserved_bytes]
    reserved = sum(stats[t].reserved_bytes for t in tags)
    free_before = device_free_bytes()
    saver.pause(tags)
    released = device_free_bytes() - free_before
    assert released >= 0.99 * reserved, (released, {t: stats[t] for t in tags})

    big = torch.empty(int(released * 0.9), dtype=torch.uint8, device="cuda")  # reuse the freed space
    big.fill_(0xFF)
    del big
    torch.cuda.empty_cache()

    saver.resume(tags)
    for b in BATCH_SIZES:
        outputs[b].zero_()
        graphs[b].replay()
    torch.cuda.synchronize()
    for b in BATCH_SIZES:
        assert torch.equal(outputs[b], eager[b]), f"replay after resume differs (b={b})"


def test_nested_regions_put_each_allocation_under_its_own_tag():
    outer, inner = unique_tag("outer"), unique_tag("inner")
    with saver.region(outer):
        a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        with saver.region(inner):
            b = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        c = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    stats = saver.stats()
    assert stats[outer].reserved_bytes == 128 * MiB
    assert stats[inner].reserved_bytes == 64 * MiB
    del a, b, c
    saver.pause([outer, inner])


def test_disable_inside_a_region_allocates_ordinary_memory():
    tag = unique_tag("disable")
    with saver.region(tag):
        kept = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        with saver.disable():
            ordinary = torch.full((16 * MiB,), 5, dtype=torch.uint8, device="cuda")
        after = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert saver.stats()[tag].reserved_bytes == 128 * MiB
    saver.pause(tag)
    assert int(ordinary.sum()) == 5 * 16 * MiB  # not paused: still readable
    saver.resume(tag)
    del kept, after
    saver.pause(tag)


@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload",
                    reason="preload mode refuses expandable segments (tested in CI)")
def test_torch_mode_works_with_expandable_segments():
    code = textwrap.dedent(
        """
        import torch
        from torch_mem_saver_lite import saver
        outside = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        with saver.region("kv"):
            kv = torch.full((1 << 30,), 9, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        saver.pause("kv")
        free1 = torch.cuda.mem_get_info()[0]
        saver.resume("kv")
        kv.fill_(3)
        print("released", free1 - free0, "outside", int(outside.sum()), "kv", int(kv[:10].sum()))
        """
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    result = run_python(code, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert int(words[1]) >= 0.99 * (1 << 30)
    assert int(words[3]) == 256 << 20 and int(words[5]) == 30


@pytest.mark.parametrize("background", ["setting backups aside", "freeing backups"])
def test_graphs_captured_while_the_saver_works_in_the_background_are_not_invalidated(background):
    # The saver page-locks and unpins host memory on background threads. Made while this
    # thread captures in global mode (torch's default), such a call would invalidate the
    # capture ("operation failed due to a previous error during capture").
    GiB = 1 << 30
    tag = unique_tag("weights")
    default_cache = saver.host_cache_bytes
    saver.host_cache_bytes = 0 if background == "freeing backups" else max(default_cache, 4 * GiB)
    saver.release_host_cache()
    try:
        with saver.region(tag, enable_cpu_backup=True):  # 2 GiB: set aside at its end
            weights = [torch.full((256 * MiB,), i, dtype=torch.uint8, device="cuda") for i in range(8)]
        if background == "freeing backups":
            saver.pause(tag)
            saver.resume(tag)  # its 2 GiB of backups are unpinned and freed in the background now
        x = torch.linspace(0, 1, 4096, device="cuda")
        for _capture in range(200):  # captures for as long as the background work may take
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x
                for _ in range(20):
                    y = y * 1.001 + 0.001
            graph.replay()
        eager = x
        for _ in range(20):
            eager = eager * 1.001 + 0.001
        assert torch.equal(y, eager)
        saver.wait_for_released_backups()
        assert all(int((w == i).sum()) == w.numel() for i, w in enumerate(weights))
    finally:
        saver.host_cache_bytes = default_cache
    del weights
    saver.empty_cache(tag)
