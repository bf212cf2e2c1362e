"""What each preset learns, and how the default one is sized from the GPU it runs on.

The learning part (model body, task, batch, schedule) is fixed per preset and was checked on
the CPU. The memory comes from two knobs that do not change what is learned:
- the vocabulary: the policy has an LLM-sized one, of which the task uses 12 tokens. The other
  tokens are masked out of every prediction, so their rows get no gradient and AdamW leaves
  them untouched (no weight decay): the learning is that of the 12-token model. The logits of
  a training micro-batch over it are what fills the trainer's memory, as they do in real RL
  trainers;
- the engine's KV cache, sized like a serving engine's from a share of the GPU (vLLM's
  gpu_memory_utilization), whatever batch a step uses.
The vocabulary is chosen so that a training step takes about TRAINER_SHARE of the GPU; the
KV cache is then sized from the trainer's measured need, so that engine and trainer together
overshoot the GPU by OVERSHOOT_SHARE while each alone leaves ENGINE_HEADROOM_SHARE free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import task
from .model import ModelConfig

TRAINER_SHARE = 0.55
OVERSHOOT_SHARE = 0.15
ENGINE_HEADROOM_SHARE = 0.08
# fp32 logits-sized tensors alive at a training step's peak, per vocabulary entry and token
# (the logits, the masked copy, log-softmax, their gradients): a first guess for choosing the
# vocabulary, which the run then measures.
LOGITS_COPIES_AT_PEAK = 4
# Rollout temporaries per decoded row: logits, the masked copy, its scaled copy,
# probabilities (fp32; three alive at once, one more for safety).
ROLLOUT_LOGITS_COPIES = 4


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    steps: int
    prompts: int
    group: int
    completion: int
    lr: float
    warmup: int = 0  # 0: constant learning rate
    micro_batches: int = 1
    rollout_batch: int | None = None  # sequences decoded at once (None: the whole step's)
    kv_slots: int | None = None  # None: just the rows a step uses

    @property
    def sequences(self) -> int:
        return self.prompts * self.group

    @property
    def decode_batch(self) -> int:
        """The largest batch the engine decodes (and captures graphs for)."""
        return min(self.sequences, self.rollout_batch or self.sequences)


def learning_preset(name: str) -> Preset:
    """The preset with the task's own 12-token vocabulary (what the CPU runs)."""
    if name == "tiny":
        completion = 6
        # Learns to count (reward 0.86-0.99 over the last 50 of 300 steps, 10 seeds on the CPU).
        return Preset(name, ModelConfig(task.VOCAB, dim=64, layers=2, heads=2, max_seq=16), steps=3,
                      prompts=8, group=8, completion=completion, lr=1e-3)
    if name == "default":
        completion = 16
        # 8192 sequences a step (decoded 2048 at a time, trained in 16 micro-batches of 512):
        # enough work per step that pausing and resuming take a small share of it. Warm-up
        # and cosine decay from 1e-2; on the CPU (12 tokens, seeds 0-2) the reward goes from
        # 0.1 to 0.99-1.0 over the last 10 of 40 steps, passing 0.95 at step 19-20 (3e-3
        # reached only 0.94).
        return Preset(name, ModelConfig(task.VOCAB, dim=64, layers=2, heads=2,
                                        max_seq=task.PROMPT_LENGTH + completion),
                      steps=40, prompts=512, group=16, completion=completion, lr=1e-2, warmup=4,
                      micro_batches=16, rollout_batch=2048)
    raise ValueError(f"unknown preset {name!r}")


def training_tokens(preset: Preset) -> int:
    """Positions one micro-batch runs through the model."""
    per_micro = -(-preset.sequences // preset.micro_batches)
    return per_micro * (task.PROMPT_LENGTH + preset.completion - 1)


def with_vocabulary_for(preset: Preset, total_bytes: int) -> Preset:
    """The preset with a vocabulary that makes a training step take about TRAINER_SHARE of
    `total_bytes` (at least the task's own)."""
    per_entry = training_tokens(preset) * 4 * LOGITS_COPIES_AT_PEAK
    vocab = max(task.VOCAB, int(TRAINER_SHARE * total_bytes / per_entry) // 64 * 64)
    return dataclasses.replace(preset, config=dataclasses.replace(preset.config, vocab=vocab))


def engine_bytes_without_kv(preset: Preset, batch: int) -> int:
    """The engine's weights plus its rollout temporaries (logits over the vocabulary)."""
    weights = preset.config.parameter_count() * 4
    return weights + ROLLOUT_LOGITS_COPIES * batch * preset.config.vocab * 4


def kv_slots_for(preset: Preset, batch: int, free_bytes: int, total_bytes: int, trainer_bytes: int) -> int:
    """KV slots for an engine that, with a trainer needing `trainer_bytes`, overshoots the
    `free_bytes` left beside the CUDA context by OVERSHOOT_SHARE of the GPU, and alone leaves
    ENGINE_HEADROOM_SHARE of it free. Never fewer than the batch."""
    engine = free_bytes - trainer_bytes + int(OVERSHOOT_SHARE * total_bytes)
    engine = min(engine, free_bytes - int(ENGINE_HEADROOM_SHARE * total_bytes))
    kv = engine - engine_bytes_without_kv(preset, batch)
    return max(batch, kv // preset.config.kv_bytes_per_slot())
