"""A synthetic task with a verifiable reward: write `length` digits whose sum hits a target.

Prompt: [BOS, tens digit of the target, units digit, SEP]. Completion: `length` digits.
Reward: 1 - |sum - target| / (9 * length), so 1.0 is exact and a random policy scores
around 0.7; learning to condition on the target is what moves it up.
"""

from __future__ import annotations

import torch

DIGITS = 10
BOS, SEP = 10, 11
VOCAB = 12
PROMPT_LENGTH = 4


def make_prompts(count: int, length: int, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts [count, 4], targets [count]) with targets uniform in [0, 9 * length]."""
    targets = torch.randint(0, 9 * length + 1, (count,), generator=generator, device="cpu").to(device)
    prompts = torch.stack([torch.full_like(targets, BOS), targets // 10, targets % 10,
                           torch.full_like(targets, SEP)], dim=1)
    return prompts, targets


def rewards(completions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """completions [n, length] of digits, targets [n] -> rewards [n] in [0, 1]."""
    length = completions.shape[1]
    error = (completions.sum(dim=1) - targets).abs().float()
    return 1.0 - error / (9 * length)


def digit_logits(logits: torch.Tensor) -> torch.Tensor:
    """Completions may only contain digits: other tokens get -inf."""
    masked = logits.clone()
    masked[..., DIGITS:] = float("-inf")
    return masked
