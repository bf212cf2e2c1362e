"""A synthetic task with a verifiable reward: count on from a number, one digit at a time.

Prompt: [BOS, tens digit of n, units digit of n, SEP] for n in [0, 99]. Each completion
digit should be one more (mod 10) than the digit before it, the first one more than the
units digit of n, so the perfect completion is the units digits of n + 1, ..., n + length.
Each digit is judged against the one actually written before it, so one slip costs one
digit, not the rest of the line. The reward is the share of right digits: a random policy
scores 0.1 and a policy that has learned to count scores 1.0, so learning is plain to see.
"""

from __future__ import annotations

import torch

DIGITS = 10
BOS, SEP = 10, 11
VOCAB = 12
PROMPT_LENGTH = 4
CHANCE = 1 / DIGITS  # expected reward of a uniformly random policy


def make_prompts(count: int, generator: torch.Generator, device) -> torch.Tensor:
    """Prompts [count, 4] for numbers uniform in [0, 99]."""
    numbers = torch.randint(0, 100, (count,), generator=generator, device="cpu")
    prompts = torch.stack([torch.full_like(numbers, BOS), numbers // 10, numbers % 10,
                           torch.full_like(numbers, SEP)], dim=1)
    return prompts.to(device)


def rewards(prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """prompts [n, 4] and completions [n, length] of digits -> rewards [n] in [0, 1]."""
    before = torch.cat([prompts[:, 2:3], completions[:, :-1]], dim=1)
    return (completions == (before + 1) % DIGITS).float().mean(dim=1)


def digit_logits(logits: torch.Tensor) -> torch.Tensor:
    """Completions may only contain digits: other tokens get -inf."""
    masked = logits.clone()
    masked[..., DIGITS:] = float("-inf")
    return masked
