"""Progress of the run: a tqdm bar in a terminal, periodic plain lines otherwise (a log file,
CI, or tqdm not installed)."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, enabled: bool = True, lines: int = 20):
        self.total = total
        self.enabled = enabled
        self.every = max(1, total // lines)
        self.bar = None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, step: int, reward: float, transition_share: float, used_gib: float) -> None:
        if not self.enabled:
            return
        fields = {"reward": f"{reward:.3f}", "transitions": f"{100 * transition_share:.0f}%",
                  "GPU": f"{used_gib:.1f}GiB"}
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total or step == 1:
            print(f"step {step}/{self.total} " + " ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
