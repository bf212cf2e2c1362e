"""The RL example's pieces on the CPU: the KV-cache decode path against the full forward,
the task and GRPO arithmetic, the engine, and the whole learning loop (without the saver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from rl import task  # noqa: E402
from rl.engine import RolloutEngine  # noqa: E402
from rl.grpo import group_advantages, policy_loss  # noqa: E402
from rl.model import ModelConfig, Policy  # noqa: E402

CONFIG = ModelConfig(task.VOCAB, dim=64, layers=2, heads=2, max_seq=16)


def test_prefill_and_decode_match_the_full_forward():
    torch.manual_seed(0)
    model = Policy(CONFIG).eval()
    sequence = torch.randint(0, 10, (3, 10))
    with torch.no_grad():
        full = model(sequence)  # logits for every position
        cache = model.new_kv_cache(4, "cpu")
        cos, sin = model.rotary("cpu")
        logits = [model.prefill(sequence[:, :4], cache, cos, sin)]
        for position in range(4, 10):
            positions = torch.full((3,), position)
            logits.append(model.decode(sequence[:, position], positions, cache, cos, sin))
    torch.testing.assert_close(torch.stack(logits, dim=1), full[:, 3:], rtol=1e-4, atol=1e-4)


def test_rewards_and_group_advantages():
    completions = torch.tensor([[9, 9, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert task.rewards(completions, torch.tensor([18, 54])).tolist() == [1.0, 0.0]
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.8]), 4)
    assert torch.allclose(advantages.view(2, 4).sum(1), torch.zeros(2), atol=1e-5)
    assert advantages[0] > 0 > advantages[1]


def test_policy_loss_pushes_up_tokens_with_positive_advantage():
    torch.manual_seed(0)
    model = Policy(CONFIG)
    sequences = torch.cat([torch.tensor([[task.BOS, 1, 8, task.SEP]]).repeat(2, 1),
                           torch.tensor([[3] * 6, [7] * 6])], dim=1)
    advantages = torch.tensor([1.0, -1.0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        optimizer.zero_grad()
        policy_loss(model(sequences[:, :-1]), sequences, 4, advantages).backward()
        optimizer.step()
    probs = model(sequences[:1, :4])[0, -1, :10].softmax(-1)
    assert probs[3] > probs[7]


def test_engine_generates_digits_for_padded_batches_on_the_cpu():
    torch.manual_seed(0)
    weights = dict(Policy(CONFIG).named_parameters())
    engine = RolloutEngine(CONFIG, weights, [1, 2, 4, 8], task.PROMPT_LENGTH, 6, torch.device("cpu"))
    prompts, _ = task.make_prompts(3, 6, torch.Generator().manual_seed(0), "cpu")
    completions = engine.generate(prompts, 1.0, torch.Generator().manual_seed(1))
    assert completions.shape == (3, 6) and int(completions.max()) < 10
    assert engine.padded_size(3) == 4
    with pytest.raises(ValueError, match="largest captured"):
        engine.padded_size(9)


def run_example(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / "rl_example.py"), *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_example_without_a_gpu_says_so_and_fails():
    result = run_example("--preset", "tiny")
    assert result.returncode == 1
    assert "no CUDA GPU available" in result.stderr


def test_learning_loop_improves_the_reward_on_the_cpu(tmp_path):
    result = run_example("--device", "cpu", "--preset", "default", "--steps", "150", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reward_last"] > summary["reward_first"] + 0.05, summary
    assert (tmp_path / "memory.png").stat().st_size > 0
