"""The running mean of the reward: one window, owned here, for the figures the summary reports
(first, last, the step where 95 % of the maximum is reached) and the line the reward plot
draws, so the picture shows the numbers the summary gives."""

from __future__ import annotations


def reward_window(steps: int) -> int:
    """Steps in the running mean of a run of `steps` steps: 10, or a third of a shorter run
    (so that its first and last windows do not overlap)."""
    return max(1, min(10, steps // 3))


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each full window: element k is the mean of values[k:k + window], the
    running mean at step k + window (steps counted from 1). Empty when fewer values than
    the window."""
    return [sum(values[k:k + window]) / window for k in range(len(values) - window + 1)]
