"""Wall time of GPU work, as every benchmark here measures it: the device idle before, and
everything the work queued finished after."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed_ms(work: Callable[[], object]) -> float:
    """Milliseconds from an idle device to the end of everything ``work`` queued."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3
