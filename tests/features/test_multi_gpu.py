"""Several GPUs: one process driving two, and two NCCL processes with a captured all-reduce
in a pauseable graph pool (marker gpu; skipped with fewer than two GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_evidence import unique_tag
from patterns import SCATTERED, pattern
from torch_mem_saver_lite import saver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
GiB = 1 << 30


def test_one_process_pauses_and_resumes_memory_on_two_gpus():
    tag = unique_tag("two-gpus")
    tensors = []
    for device in (0, 1):
        with torch.cuda.device(device), saver.region(tag, enable_cpu_backup=True):
            tensors.append(torch.empty(GiB, dtype=torch.uint8, device=f"cuda:{device}"))
        tensors[-1].copy_(pattern(GiB, device, device=f"cuda:{device}", **SCATTERED))
    for device in (0, 1):
        torch.cuda.synchronize(device)
    before = [torch.cuda.mem_get_info(d)[0] for d in (0, 1)]
    saver.pause(tag)
    after = [torch.cuda.mem_get_info(d)[0] for d in (0, 1)]
    assert all(a - b >= 0.99 * GiB for a, b in zip(after, before, strict=True)), (before, after)
    saver.resume(tag)
    for device, t in enumerate(tensors):
        assert torch.equal(t, pattern(GiB, device, device=f"cuda:{device}", **SCATTERED))
    del tensors
    saver.pause(tag)


def test_two_processes_with_nccl_replay_a_captured_all_reduce_after_resume():
    worker = Path(__file__).with_name("nccl_worker.py")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(worker)], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("rank ok") == 2, result.stdout
