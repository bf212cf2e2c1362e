"""The trainer: its own weights, gradients and AdamW state, all in the region "train" with
CPU backup, so the whole training state can be paused during rollout and come back intact.

Gradients are allocated up front inside the region: autograd runs the backward pass on
its own thread, where a region (which is per thread) would not reach them.
"""

from __future__ import annotations

import contextlib

import torch

from .grpo import policy_loss
from .model import ModelConfig, Policy


class Trainer:
    def __init__(self, config: ModelConfig, lr: float, device: torch.device, saver=None,
                 distributed: bool = False, seed: int = 0):
        self.saver = saver
        torch.manual_seed(seed)
        with self.region(), torch.device(device):
            self.policy = Policy(config)
            for parameter in self.policy.parameters():
                parameter.grad = torch.zeros_like(parameter)
            self.model = self.policy
            if distributed:
                self.model = torch.nn.parallel.DistributedDataParallel(
                    self.policy, device_ids=[device.index] if device.type == "cuda" else None)
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr, betas=(0.9, 0.99),
                                               weight_decay=0.0)

    def region(self):
        if self.saver is None:
            return contextlib.nullcontext()
        return self.saver.region("train", enable_cpu_backup=True)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.policy.named_parameters())

    def step(self, sequences: torch.Tensor, prompt_length: int, advantages: torch.Tensor) -> float:
        with self.region():
            logits = self.model(sequences[:, :-1])
            loss = policy_loss(logits, sequences, prompt_length, advantages)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()  # the first step creates AdamW's state, inside the region
            self.optimizer.zero_grad(set_to_none=False)  # keep the gradient tensors where they are
        return float(loss.detach())
