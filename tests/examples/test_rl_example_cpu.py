"""The RL example's pieces on the CPU: the KV-cache decode path against the full forward,
the task and GRPO arithmetic, the engine, and the whole learning loop (without the saver)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from rl import task  # noqa: E402
from rl.engine import RolloutEngine  # noqa: E402
from rl.grpo import group_advantages, policy_loss  # noqa: E402
from rl.model import ModelConfig, Policy  # noqa: E402
from rl.presets import kv_slots_for, learning_preset, training_tokens, with_vocabulary_for  # noqa: E402
from rl.trainer import Trainer, warmup_cosine  # noqa: E402

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


def test_counting_reward_judges_each_digit_against_the_one_before_it():
    prompts = task.make_prompts(64, torch.Generator().manual_seed(0), "cpu")
    units = prompts[:, 2]
    counted = (units[:, None] + torch.arange(1, 7)) % 10
    assert task.rewards(prompts, counted).tolist() == [1.0] * 64
    slipped = counted.clone()
    slipped[:, 2] = (slipped[:, 2] + 5) % 10  # one wrong digit breaks the count at two places
    assert torch.equal(task.rewards(prompts, slipped), torch.full((64,), 4 / 6))
    # A uniformly random policy gets each digit right one time in ten.
    noise = torch.randint(0, 10, (64, 6), generator=torch.Generator().manual_seed(1))
    chance = torch.stack([task.rewards(prompts, noise.roll(k, 0)) for k in range(64)]).mean()
    assert abs(float(chance) - task.CHANCE) < 0.03


def test_group_advantages_center_each_group():
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
    prompts = task.make_prompts(3, torch.Generator().manual_seed(0), "cpu")
    completions = engine.generate(prompts, 1.0, torch.Generator().manual_seed(1))
    assert completions.shape == (3, 6) and int(completions.max()) < 10
    assert engine.padded_size(3) == 4
    with pytest.raises(ValueError, match="largest captured"):
        engine.padded_size(9)


def run_example(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / "rl_example.py"), *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def test_example_without_a_gpu_says_so_and_fails():
    """No GPU visible (none on the machine, or hidden as here): it says so and exits 1, and
    with a CPU build of torch (torch.version.cuda is None) says how to get a CUDA one."""
    result = run_example("--preset", "tiny", CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "no CUDA GPU available: the RL example needs an NVIDIA GPU" in result.stderr
    assert ("is a CPU build: install a CUDA build" in result.stderr) == (torch.version.cuda is None), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("cuda_build", [None, "12.8"])
def test_the_no_gpu_message_points_a_cpu_build_of_torch_to_a_cuda_one(cuda_build, monkeypatch):
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")  # what importing the example sets, undone after the test
    import rl_example

    message = rl_example.no_gpu_message(cuda_build)
    assert message.startswith("no CUDA GPU available")
    assert ("pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu" in message) == (
        cuda_build is None)



def test_the_no_gpu_message_says_what_runs_here_and_each_thing_it_names_exists(monkeypatch):
    """Without a GPU a newcomer is told what they can run instead: the CPU learning loop (a
    command the example's own parser takes, the one the slow learning test runs) and the host
    backend (a class that exists), with the guide's section on it."""
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")  # what importing the example sets, undone after the test
    import rl_example

    for cuda_build in (None, "12.8"):
        message = rl_example.no_gpu_message(cuda_build)
        command = re.search(r"`python examples/rl_example\.py ([^`]+)`", message)
        assert command, message
        monkeypatch.setattr(sys, "argv", ["rl_example.py", *command.group(1).split()])
        args = rl_example.parse_args()
        assert (args.device, args.preset, args.steps) == ("cpu", "tiny", 300)
        module, _, name = re.search(r"`(torch_mem_saver_lite\.testing\.\w+)`", message).group(1).rpartition(".")
        assert name == "HostSaver" and getattr(importlib.import_module(module), name)
        page, heading = re.search(r'\((docs/\w+\.md), "([^"]+)"\)', message).groups()
        assert f"\n## {heading}\n" in (EXAMPLES.parent / page).read_text(), (page, heading)


@pytest.mark.slow  # minutes on 2 cores
def test_learning_loop_learns_to_count_on_the_cpu(tmp_path):
    """The tiny preset learns the counting task from chance (0.1) to near 1.0.

    Why the margins are safe: over seeds 0-9 (and with ATEN_CPU_CAPABILITY=default and
    avx2, which gave the same figures), 300 steps gave a first-10-step mean of 0.145-0.196
    and a last-50-step mean of 0.859-0.994. The bounds below sit 0.15 and 0.26 away from the
    worst of those, several times the spread between seeds (0.04). A loop that does not learn
    (no optimizer step, the wrong sign, stale engine weights) stays near 0.1-0.2 and fails.
    """
    result = run_example("--device", "cpu", "--preset", "tiny", "--steps", "300", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    rewards = [record["reward"] for record in summary["records"]]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-50:]) / 50
    assert first < 0.35, summary["records"][:10]
    assert last > 0.6, (first, last)
    assert (tmp_path / "reward.png").stat().st_size > 0
    assert summary["reward"]["chance"] == task.CHANCE and summary["guard_passed_every_step"]


@pytest.mark.parametrize("total_gib", [16, 80, 141])
def test_default_preset_fits_each_engine_alone_and_not_both(total_gib):
    """The sizing arithmetic: a training step takes about half the GPU, and the KV cache is
    sized from what training needs so that both together overshoot the GPU and each alone
    leaves room."""
    total = total_gib << 30
    free = total - (1 << 29)  # the CUDA context
    preset = with_vocabulary_for(learning_preset("default"), total)
    assert preset.config.vocab > 1000
    for trainer in (int(0.3 * total), int(0.55 * total), int(0.8 * total)):  # the guess may be off either way
        batch = preset.decode_batch  # what the engine decodes at once, as the example sizes it
        slots = kv_slots_for(preset, batch, free, total, trainer)
        kv = slots * preset.config.kv_bytes_per_slot()
        engine = kv + 4 * batch * preset.config.vocab * 4 + preset.config.parameter_count() * 4
        assert slots >= batch
        assert engine + trainer > free + 0.1 * total, (total_gib, trainer, engine)
        assert engine < free - 0.05 * total and trainer < free


def test_micro_batches_add_up_to_the_whole_batch():
    """Four micro-batches give the gradient of the whole batch (one optimizer step)."""
    preset = learning_preset("default")
    sequences = torch.randint(0, 10, (16, task.PROMPT_LENGTH + preset.completion))
    advantages = torch.randn(16)
    grads = []
    for micro in (1, 4):
        trainer = Trainer(preset.config, 1e-3, torch.device("cpu"), seed=0)
        trainer._accumulate(sequences, task.PROMPT_LENGTH, advantages, micro)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    per_micro_batch = -(-preset.sequences // preset.micro_batches)
    assert training_tokens(preset) == per_micro_batch * (task.PROMPT_LENGTH + preset.completion - 1)


def test_the_default_preset_decodes_in_chunks_that_cover_the_step():
    preset = learning_preset("default")
    assert preset.decode_batch == min(preset.sequences, preset.rollout_batch)
    assert preset.sequences % preset.decode_batch == 0 and preset.sequences % preset.micro_batches == 0


def test_learning_rate_warms_up_then_decays_to_its_floor():
    factor = warmup_cosine(10, 100, floor=0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0) and factor(100) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(10, 100))


def test_make_run_installs_the_package_with_the_examples_extra_alone():
    """`make run` installs what the example needs (the package and its `examples` extra:
    plots, a progress bar), none of the test tools, and then runs the example."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("needs make")
    root = EXAMPLES.parent
    alone = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # not a sub-make
    dry = subprocess.run(["make", "-n", "--no-print-directory", "run", f"PYTHON={sys.executable}"], cwd=root,
                         capture_output=True, text=True, timeout=120, check=True, env=alone).stdout.splitlines()
    editable = [line for line in dry if "pip install" in line and " -e " in line]
    assert len(editable) == 1 and editable[0].endswith(' -e ".[examples]"'), dry
    assert not any(tool in line for line in dry for tool in ("pytest", "hypothesis", "cuda-python", "[test")), dry
    interpreter, script = dry[-1].rsplit(" ", 1)  # the venv's python where make made one
    assert script == "examples/rl_example.py" and os.path.basename(interpreter).startswith("python"), dry
