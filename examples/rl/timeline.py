"""What a run records as it goes: GPU memory in use over time, the span of every phase, and
the wall time of each phase within a step."""

from __future__ import annotations

import contextlib
import time

import torch

from torch_mem_saver_lite import saver

# Phases that move the GPU from one engine to the other (the rest is useful work or checking).
TRANSITIONS = ("engine_pause", "trainer_resume", "trainer_pause", "engine_resume", "weight_sync")


def used_bytes(device: torch.device) -> int:
    """Device memory in use by every process (the driver's view), after pending work."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class Timeline:
    """Memory samples (seconds, bytes) and phase spans (phase, start, end) since the start: GPU
    memory in use, and the host memory the node's processes hold for backups and host caches
    against the node's budget (saver.host_memory())."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self.host_samples: list[tuple[float, int]] = []
        self.host_budget = saver.host_memory().budget_bytes
        self.spans: list[tuple[str, float, float]] = []

    def now(self) -> float:
        return time.perf_counter() - self.start

    def sample(self) -> int:
        used = used_bytes(self.device)
        now = self.now()
        self.samples.append((now, used))
        host = saver.host_memory()
        self.host_samples.append((now, host.held_by_this_process + host.held_by_others))
        return used

    @contextlib.contextmanager
    def phase(self, name: str, seconds: dict[str, float]):
        """Times the block into `seconds[name]` (GPU work included) and samples memory after it."""
        start = self.now()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = self.now()
        seconds[name] = seconds.get(name, 0.0) + end - start
        self.spans.append((name, start, end))
        self.sample()


def transition_share(seconds: dict[str, float], step_seconds: float) -> float:
    return sum(seconds.get(name, 0.0) for name in TRANSITIONS) / step_seconds if step_seconds > 0 else 0.0
