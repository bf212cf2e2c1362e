"""GRPO pieces: group-relative advantages and the policy-gradient loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .task import digit_logits


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Rewards [prompts * group] -> advantages: each reward against its group's mean and std."""
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return (centered / (grouped.std(dim=1, keepdim=True) + eps)).view(-1)


def policy_loss(logits: torch.Tensor, sequences: torch.Tensor, prompt_length: int,
                advantages: torch.Tensor) -> torch.Tensor:
    """-mean(advantage * log-prob of each completion token).

    logits [n, t - 1, vocab] predict sequences[:, 1:]; only completion tokens count.
    """
    predicted = digit_logits(logits[:, prompt_length - 1:])
    targets = sequences[:, prompt_length:]
    logprobs = -F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), targets.reshape(-1),
                                reduction="none").view(targets.shape)
    return -(advantages[:, None] * logprobs).mean()
