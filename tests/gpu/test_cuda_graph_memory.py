"""Graph memory across pause/resume with the default settings (marker gpu): state a graph
reads but never rewrites, torch.compile's graph trees, poison, and tag hooks on real memory.
test_preload_mode.py runs this file again in preload mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cuda_evidence import device_free_bytes, unique_tag
from torch_mem_saver_lite import _lib, saver

pytestmark = pytest.mark.gpu
N = 1 << 22  # floats: 16 MiB per tensor


def capture_graph_reading_a_table(tag: str, **backup):
    """A graph that reads `table`, memory of its pool written once after capture and never
    by a replay (as engines fill buffers they allocated while capturing)."""
    static_in = torch.randn(N, device="cuda")  # outside regions: the caller's input
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag=tag, **backup):
        table = torch.empty(N, device="cuda")
        out = static_in * table + 1
    table.copy_(torch.linspace(-3, 3, N, device="cuda"))
    graph.replay()
    return graph, out, out.clone()


def test_a_graph_reading_state_written_once_replays_right_after_resume_by_default():
    tag = unique_tag("graphs")
    graph, out, expected = capture_graph_reading_a_table(tag)
    stats = saver.stats()[tag]
    assert stats.graph_memory and stats.backs_up
    free = device_free_bytes()
    saver.pause(tag)
    assert device_free_bytes() - free >= 0.99 * stats.reserved_bytes
    saver.resume(tag)
    graph.replay()
    assert torch.equal(out, expected)


def test_without_the_backup_the_same_graph_reads_the_poison_pattern():
    tag = unique_tag("graphs")
    graph, out, expected = capture_graph_reading_a_table(tag, enable_cpu_backup=False)
    assert not saver.stats()[tag].backs_up
    saver.poison_on_resume = True
    try:
        saver.pause(tag)
        saver.resume(tag)
    finally:
        saver.poison_on_resume = False
    graph.replay()
    assert torch.isnan(out).all()  # the table came back as NaN, loudly


def test_reduce_overhead_model_recorded_in_a_region_is_bit_equal_after_resume():
    tag = unique_tag("compiled")
    torch.manual_seed(0)
    x = torch.randn(256, 1024, device="cuda")
    with saver.region(tag), torch.no_grad():  # weights, compiled constants and graph trees
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024)).cuda()
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            compiled(x)
    with torch.no_grad():
        before = compiled(x).clone()
        eager = model(x)
    torch.testing.assert_close(before, eager)
    stats = saver.stats()[tag]
    assert stats.graph_memory and stats.backs_up  # the capture inside the region was noticed

    free = device_free_bytes()
    saver.pause(tag)
    assert device_free_bytes() - free >= 0.99 * stats.reserved_bytes
    saver.resume(tag)
    with torch.no_grad():
        after = [compiled(x).clone() for _ in range(3)]
    for result in after:
        assert torch.equal(result, before)


def test_tag_hooks_bracket_real_mappings_and_a_failing_hook_leaves_the_tag_paused():
    tag = unique_tag("registered")
    with saver.region(tag, enable_cpu_backup=True):
        t = torch.arange(N, device="cuda", dtype=torch.float32)
    expected = float(t.sum())
    seen = []
    remove = saver.register_hooks(tag, before_pause=lambda: seen.append(("pause", float(t.sum()))),
                                  after_resume=lambda: seen.append(("resume", float(t.sum()))))
    saver.pause(tag)
    saver.resume(tag)
    assert seen == [("pause", expected), ("resume", expected)]  # mapped, with content, both times

    failing = {"now": True}

    def reregister():
        if failing["now"]:
            raise RuntimeError("re-registration failed")

    remove_failing = saver.register_hooks(tag, after_resume=reregister)
    saver.pause(tag)
    with pytest.raises(RuntimeError, match="re-registration failed"):
        saver.resume(tag)
    stats = saver.stats()[tag]
    assert stats.paused and stats.resident_bytes == 0 and stats.host_backup_bytes == stats.reserved_bytes
    failing["now"] = False
    saver.resume(tag)
    assert float(t.sum()) == expected
    remove()
    remove_failing()


@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="starts its own preloaded process")
def test_tag_rules_hold_for_allocations_from_preload_defaults():
    code = textwrap.dedent(
        """
        import torch
        from torch_mem_saver_lite import _lib, saver
        saver.hook_mode = "preload"
        x = torch.ones(1 << 20, device="cuda")  # no Python region: the process default takes it
        stats = saver.stats()["everything"]
        print("default tag", stats.allocations > 0, stats.backs_up)
        with saver.region("everything", enable_cpu_backup=False):  # its own choice: no backup
            y = torch.ones(1 << 20, device="cuda")
        saver.pause("everything")
        try:
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        except Exception:
            print("refused", "'everything' is paused" in str(_lib.last_error()))
        saver.resume("everything")
        print("restored", bool((x == 1).all()))
        print("backs up", saver.stats()["everything"].backs_up)
        """
    )
    env = {**os.environ, "LD_PRELOAD": _lib.library_path(), "TMSL_REGION_ALL_THREADS": "1",
           "TMSL_DEFAULT_TAG": "everything", "TMSL_DEFAULT_CPU_BACKUP": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:4] == ["default tag True True", "refused True", "restored True",
                                             "backs up True"], result.stdout + result.stderr[-2000:]
