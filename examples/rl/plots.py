"""The two pictures of a run: GPU and host memory over its first steps with the start and the
phases shaded, and the reward with the running mean the summary reports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .smoothing import running_mean

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GiB, MiB = 1 << 30, 1 << 20
PHASE_COLORS = {"rollout": "tab:blue", "train": "tab:orange"}
TRANSITION_COLOR = "tab:red"
STARTUP_COLOR = "tab:gray"
# What rl_example.py does before its first rollout (Run.run: measure_baseline, build).
STARTUP_LABEL = "start: trainer and engine built, decode graphs captured"
# The host panel draws the node's budget only where its holdings reach this share of it: a
# budget of tens of GiB against backups of hundreds of MiB would press the data to the floor.
BUDGET_SHOWN_FROM = 0.25


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def shown_until(spans: list[tuple[str, float, float]], steps: int) -> float | None:
    """Where the first `steps` steps end (the next rollout's start); None: the run is shorter."""
    rollouts = [start for phase, start, _ in spans if phase == "rollout"]
    return rollouts[steps] if len(rollouts) > steps else None


def byte_unit(values: list[int]) -> tuple[str, int]:
    """The unit a panel of these byte counts is drawn in: MiB while they stay below 2 GiB (in
    GiB a few hundred MiB are a flat line on the floor), GiB above."""
    return ("MiB", MiB) if max(values, default=0) < 2 * GiB else ("GiB", GiB)


def size_text(nbytes: int) -> str:
    unit_name, unit = byte_unit([nbytes])
    return f"{nbytes / unit:.0f} {unit_name}" if nbytes >= 10 * unit or nbytes % unit == 0 else \
        f"{nbytes / unit:.1f} {unit_name}"


def memory_plot(samples: list[tuple[float, int]], host_samples: list[tuple[float, int]], host_budget: int,
                spans: list[tuple[str, float, float]], capacity: int, no_saver_need: int | None,
                baseline: int | None, title: str, path: Path, steps: int = 3) -> Figure:
    """GPU memory in use against the GPU's capacity and what both engines would need without
    the saver, and below it the host memory the node holds for backups against its budget,
    over the first `steps` steps (all of them show the same pattern); the start (from 0 to the
    first rollout), rollout, training and the transitions between them shaded. Returns the
    figure (closed; its artists stay readable)."""
    plt = _pyplot()
    fig, (ax, host_ax) = plt.subplots(2, 1, figsize=(11, 7.2), sharex=True, height_ratios=[3, 1.4])
    end = shown_until(spans, steps)
    labelled: set[str] = set()
    first_phase = min((start for _, start, _ in spans), default=None)
    for axis in (ax, host_ax):
        if first_phase:
            axis.axvspan(0, first_phase, color=STARTUP_COLOR, alpha=0.15, linewidth=0,
                         label=None if axis is host_ax else STARTUP_LABEL)
        for phase, start, stop in spans:
            color = PHASE_COLORS.get(phase, TRANSITION_COLOR if phase != "guard" else None)
            if color is None or (end is not None and start >= end):
                continue
            label = phase if phase in PHASE_COLORS else "transitions (pause, resume, weight sync)"
            axis.axvspan(start, stop, color=color, alpha=0.18 if phase in PHASE_COLORS else 0.5, linewidth=0,
                         label=None if label in labelled or axis is host_ax else label)
            labelled.add(label)
    shown = [(x, y) for x, y in samples if end is None or x <= end]
    if shown:
        xs, ys = zip(*shown, strict=True)
        # Each sample is taken at the end of a phase and holds for the phase before it (the
        # caching allocator keeps a phase's peak until it is released).
        ax.step(xs, [y / GiB for y in ys], where="pre", color="black", linewidth=1.2, label="GPU memory in use")
    ax.axhline(capacity / GiB, color="tab:green", linewidth=2, label=f"GPU capacity ({capacity / GiB:.0f} GiB)")
    if no_saver_need:
        ax.axhline(no_saver_need / GiB, color="tab:purple", linewidth=2, linestyle="--",
                   label=f"needed without the saver: engine + trainer ({no_saver_need / GiB:.0f} GiB)")
    if baseline:
        ax.axhline(baseline / GiB, color="tab:gray", linewidth=1, linestyle=":",
                   label=f"bare CUDA context at start ({baseline / GiB:.2f} GiB)")
    top = max([capacity, no_saver_need or 0] + [y for _, y in shown])
    ax.set_ylim(0, top / GiB * 1.12)
    ax.set_xlim(left=0, right=end)
    ax.set_ylabel("GPU memory in use (GiB)")
    ax.set_title(title + (f" (the first {steps} steps)" if end is not None else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=8, ncol=3, frameon=False)
    host_shown = [(x, y) for x, y in host_samples if end is None or x <= end]
    held = [y for _, y in host_shown]
    budget_shown = bool(host_budget) and max(held, default=0) >= BUDGET_SHOWN_FROM * host_budget
    unit_name, unit = byte_unit(held + ([host_budget] if budget_shown else []))
    held_label = "host memory held for backups and host caches (the node's processes)"
    if host_budget and not budget_shown:
        held_label += f"; the node's budget, {size_text(host_budget)}, is off the scale"
    if host_shown:
        xs, ys = zip(*host_shown, strict=True)
        host_ax.step(xs, [y / unit for y in ys], where="pre", color="tab:brown", linewidth=1.2, label=held_label)
    if budget_shown:
        host_ax.axhline(host_budget / unit, color="tab:red", linewidth=1.5, linestyle="--",
                        label=f"the node's host-memory budget ({size_text(host_budget)})")
    host_top = max(held + ([host_budget] if budget_shown else []), default=0)
    host_ax.set_ylim(0, max(host_top, unit) / unit * 1.15)
    host_ax.set_xlabel("seconds since start")
    host_ax.set_ylabel(f"host memory ({unit_name})")
    host_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=8, ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def reward_plot(rewards: list[float], figures: dict, title: str, path: Path) -> Figure:
    """Mean reward per step and the running mean of the summary's `figures` (its window, its
    first and last values, the step where it reaches 95 % of the maximum), against chance and
    the 95 %-of-maximum line. Returns the figure (closed; its artists stay readable)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    window, best = figures["window"], figures["max"]
    means = running_mean(rewards, window)
    ax.plot(range(1, len(rewards) + 1), rewards, alpha=0.35, color="tab:blue", label="mean reward of the step")
    # Drawn from the first full window on, as the summary counts it: the line starts at its
    # "first" figure and ends at its "last".
    ax.plot(range(window, len(rewards) + 1), means, color="tab:blue",
            label=f"running mean of {window} steps (the summary's: {figures['first']:.3f} → {figures['last']:.3f})")
    ax.axhline(figures["chance"], color="tab:gray", linestyle=":", label=f"chance ({figures['chance']:.2f})")
    ax.axhline(0.95 * best, color="tab:green", linestyle="--", label="95 % of the maximum")
    reached = figures["reached_95_percent_at_step"]
    if reached is not None:
        ax.plot([reached], [means[reached - window]], "o", color="tab:green",
                label=f"running mean reaches 95 % at step {reached}")
    ax.set_ylim(0, best * 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (share of digits counted right)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
