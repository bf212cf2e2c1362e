"""The two pictures of a run: GPU and host memory over its first steps with the phases shaded,
and the reward."""

from __future__ import annotations

from pathlib import Path

GiB = 1 << 30
PHASE_COLORS = {"rollout": "tab:blue", "train": "tab:orange"}
TRANSITION_COLOR = "tab:red"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def shown_until(spans: list[tuple[str, float, float]], steps: int) -> float | None:
    """Where the first `steps` steps end (the next rollout's start); None: the run is shorter."""
    rollouts = [start for phase, start, _ in spans if phase == "rollout"]
    return rollouts[steps] if len(rollouts) > steps else None


def memory_plot(samples: list[tuple[float, int]], host_samples: list[tuple[float, int]], host_budget: int,
                spans: list[tuple[str, float, float]], capacity: int, no_saver_need: int | None,
                baseline: int | None, title: str, path: Path, steps: int = 3) -> None:
    """GPU memory in use against the GPU's capacity and what both engines would need without
    the saver, and below it the host memory the node holds for backups against its budget,
    over the first `steps` steps (all of them show the same pattern); rollout, training and
    the transitions between them shaded."""
    plt = _pyplot()
    fig, (ax, host_ax) = plt.subplots(2, 1, figsize=(11, 7.2), sharex=True, height_ratios=[3, 1.4])
    end = shown_until(spans, steps)
    labelled: set[str] = set()
    for axis in (ax, host_ax):
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
    if host_shown:
        xs, ys = zip(*host_shown, strict=True)
        host_ax.step(xs, [y / GiB for y in ys], where="pre", color="tab:brown", linewidth=1.2,
                     label="host memory held for backups and host caches (the node's processes)")
    if host_budget:
        host_ax.axhline(host_budget / GiB, color="tab:red", linewidth=1.5, linestyle="--",
                        label=f"the node's host-memory budget ({host_budget / GiB:.0f} GiB)")
    host_top = max([host_budget] + [y for _, y in host_shown])
    host_ax.set_ylim(0, max(host_top, 1) / GiB * 1.15)
    host_ax.set_xlabel("seconds since start")
    host_ax.set_ylabel("host memory (GiB)")
    host_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=8, ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reward_plot(rewards: list[float], chance: float, best: float, title: str, path: Path) -> None:
    """Mean reward per step, its running mean, chance and the 95 %-of-maximum line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = range(1, len(rewards) + 1)
    window = max(1, len(rewards) // 20)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
              for i in range(len(rewards))]
    ax.plot(steps, rewards, alpha=0.35, color="tab:blue", label="mean reward of the step")
    ax.plot(steps, smooth, color="tab:blue", label=f"running mean of {window}")
    ax.axhline(chance, color="tab:gray", linestyle=":", label=f"chance ({chance:.2f})")
    ax.axhline(0.95 * best, color="tab:green", linestyle="--", label="95 % of the maximum")
    ax.set_ylim(0, best * 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (share of digits counted right)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
