"""Hardening on the GPU: no pause during capture, a graph replays correctly after a failed
then retried resume, and a GPU soak shows no growth (marker gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_evidence import device_free_bytes, unique_tag
from torch_mem_saver_lite import MemorySaverError, OutOfMemoryError, saver

pytestmark = pytest.mark.gpu
GiB = 1 << 30


def test_pause_and_resume_during_graph_capture_are_refused():
    tag = unique_tag("capture")
    with saver.region(tag):
        x = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(MemorySaverError, match="being captured"):
        with torch.cuda.graph(graph):
            y = x * 2
            saver.pause(tag)
    assert saver.stats()[tag].paused_bytes == 0
    del y


def test_graph_replays_correctly_after_a_failed_then_retried_resume():
    weights_tag, graph_tag = unique_tag("weights"), unique_tag("graph")
    with saver.region(weights_tag, enable_cpu_backup=True):
        w = torch.randn(2048, 2048, device="cuda")
    x = torch.randn(64, 2048, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ w
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag=graph_tag):
        out = x @ w
    graph.replay()
    expected = out.clone()

    saver.pause([weights_tag, graph_tag])
    torch.cuda.empty_cache()
    filler = torch.empty(device_free_bytes() - (8 << 20), dtype=torch.uint8, device="cuda")
    with pytest.raises(OutOfMemoryError):
        saver.resume([weights_tag, graph_tag])
    del filler
    torch.cuda.empty_cache()
    saver.resume([weights_tag, graph_tag])
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_soak_script_reports_no_growth():
    script = Path(__file__).resolve().parents[1] / "soaks" / "soak_gpu.py"
    result = subprocess.run([sys.executable, str(script), "--cycles", "200", "--mib", "256"],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no growth" in result.stdout
