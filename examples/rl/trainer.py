"""The trainer: its own weights, gradients and AdamW state, all in the region "train" with
CPU backup, so the whole training state can be paused during rollout and come back intact.

Gradients are allocated up front inside the region: autograd runs the backward pass on
its own thread, where a region (which is per thread) would not reach them.

Activations are not in the region: they live only during the step, so they go to torch's
ordinary allocator and are given back after it (`release_leftovers`), instead of being
copied to the host at every pause. The batch is split into micro-batches whose gradients
add up before one optimizer step, as RL trainers do to bound activation memory.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .grpo import policy_loss
from .model import ModelConfig, Policy


def warmup_cosine(warmup: int, steps: int, floor: float = 0.1):
    """Learning-rate factor: linear warm-up over `warmup` steps, then cosine down to `floor`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class Trainer:
    def __init__(self, config: ModelConfig, lr: float, device: torch.device, saver=None,
                 distributed: bool = False, seed: int = 0, lr_factor=None):
        self.saver = saver
        self.distributed = distributed
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
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor or (lambda step: 1.0))

    def region(self):
        if self.saver is None:
            return contextlib.nullcontext()
        return self.saver.region("train", enable_cpu_backup=True)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.policy.named_parameters())

    def state_bytes(self) -> int:
        """Weights, gradients and both AdamW moments: what the region holds once trained."""
        return 4 * sum(p.numel() * p.element_size() for p in self.policy.parameters())

    def _accumulate(self, sequences: torch.Tensor, prompt_length: int, advantages: torch.Tensor,
                    micro_batches: int) -> float:
        """Forward and backward over the micro-batches, gradients summed into .grad."""
        n = sequences.shape[0]
        total = torch.zeros((), device=sequences.device)
        chunks = list(zip(sequences.chunk(micro_batches), advantages.chunk(micro_batches), strict=True))
        for i, (part, part_advantages) in enumerate(chunks):
            # DDP all-reduces once, after the last micro-batch.
            last = i == len(chunks) - 1
            sync = self.model.no_sync() if self.distributed and not last else contextlib.nullcontext()
            with sync:
                loss = policy_loss(self.model(part[:, :-1]), part, prompt_length, part_advantages)
                loss = loss * (part.shape[0] / n)
                loss.backward()
            total += loss.detach()
            del loss
        return float(total)

    def step(self, sequences: torch.Tensor, prompt_length: int, advantages: torch.Tensor,
             micro_batches: int = 1) -> float:
        loss = self._accumulate(sequences, prompt_length, advantages, micro_batches)
        with self.region():
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()  # the first step creates AdamW's state, inside the region
            self.optimizer.zero_grad(set_to_none=False)  # keep the gradient tensors where they are
        self.schedule.step()
        return loss

    def activation_peak_bytes(self, sequences: torch.Tensor, prompt_length: int, micro_batches: int) -> int:
        """GPU memory one training step needs beyond the trainer's state, measured by running
        forward and backward on `sequences` without an optimizer step (gradients zeroed after)."""
        device = sequences.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.mem_get_info(device)
        advantages = torch.ones(sequences.shape[0], device=device)
        part = sequences[: math.ceil(sequences.shape[0] / micro_batches)]
        with contextlib.ExitStack() as stack:
            if self.distributed:
                stack.enter_context(self.model.no_sync())  # a probe, not a step: no all-reduce
            policy_loss(self.model(part[:, :-1]), part, prompt_length, advantages[: part.shape[0]]).backward()
        torch.cuda.synchronize(device)
        after = torch.cuda.mem_get_info(device)
        self.optimizer.zero_grad(set_to_none=False)
        torch.cuda.empty_cache()
        return max(0, before[0] - after[0])
