"""The RL example on the GPU: tiny preset, both hook modes, the guard passing every step and
the engine's memory really released while training (marker gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_example.py"


@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload",
                    reason="runs both hook modes itself; preload re-executes with LD_PRELOAD")
@pytest.mark.parametrize("hook_mode", ["torch", "preload"])
def test_tiny_preset_runs_three_steps_with_the_guard_passing(hook_mode, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TMSL_TEST_HOOK_MODE")}
    result = subprocess.run([sys.executable, str(EXAMPLE), "--preset", "tiny", "--steps", "3",
                             "--hook-mode", hook_mode, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["guard_passed_every_step"] and summary["hook_mode"] == hook_mode
    for record in summary["records"]:
        assert record["guard_ok"]
        # The engine's weights, KV cache and graph pool really leave the GPU for training.
        assert record["released_at_pause_bytes"] >= 0.99 * record["inference_bytes"], record
        # Training runs in less than the rollout peak minus the engine, plus the trainer's state.
        assert (record["train_used_bytes"] - record["train_resident_bytes"]
                <= record["rollout_used_bytes"] - 0.99 * record["inference_bytes"] + (256 << 20)), record


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_on_two_gpus(tmp_path):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    env.pop("LD_PRELOAD", None)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(EXAMPLE), "--preset", "tiny", "--steps", "3", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["guard_passed_every_step"]
