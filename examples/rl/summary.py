"""What a run leaves behind: summary.json (sizes, residual memory, time per phase, reward,
guard) and the two plots; and the report of a run that ran out of memory."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import task
from .plots import memory_plot, reward_plot
from .smoothing import reward_window, running_mean
from .timeline import TRANSITIONS

GiB = 1 << 30
MiB = 1 << 20
REWARD_MAX = 1.0


@dataclass
class OutOfMemory(Exception):
    """A step did not fit: what the engine held, what training needed, what the GPU has."""

    step: int
    capacity: int
    baseline: int
    engine: int
    trainer: int
    message: str
    preset: str
    vocab: int
    saver: bool

    def explain(self) -> str:
        need = self.baseline + self.engine + self.trainer
        if self.saver:
            return (f"out of GPU memory at step {self.step}, training, with the engine paused: {self.message}\n"
                    f"a training step was measured to need {self.trainer / GiB:.1f} GiB on a GPU of "
                    f"{self.capacity / GiB:.1f} GiB; something else holds memory on this GPU?")
        return (f"out of GPU memory at step {self.step}, training: {self.message}\n"
                f"the engine holds {self.engine / GiB:.1f} GiB (weights, KV cache, graph pool), a training step "
                f"needs {self.trainer / GiB:.1f} GiB more, and the CUDA context {self.baseline / GiB:.1f} GiB: "
                f"{need / GiB:.1f} GiB together on a GPU of {self.capacity / GiB:.1f} GiB.\n"
                f"Each fits alone: run without --no-saver, which pauses the engine while the trainer runs.")


def write_out_of_memory(out: Path, failure: OutOfMemory) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in asdict(failure).items()}
    summary = {"outcome": "out_of_memory", **fields,
               "need_bytes": failure.baseline + failure.engine + failure.trainer}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def timing(records: list[dict]) -> dict:
    """Median seconds per phase and the share of the step spent in transitions, from step 2
    on (step 1 also prepares host memory and loads kernels), and over every step."""
    steady = records[1:] or records
    phases = sorted({name for r in records for name in r["seconds"]})
    per_phase = {name: _median([r["seconds"].get(name, 0.0) for r in steady]) for name in phases}
    transitions = sum(sum(r["seconds"].get(n, 0.0) for n in TRANSITIONS) for r in steady)
    step_total = sum(r["step_seconds"] for r in steady)
    everything = sum(sum(r["seconds"].get(n, 0.0) for n in TRANSITIONS) for r in records)
    # The graph pool's own pause and resume (with its backup), within the engine's transitions.
    graph = [r.get("graph_pause_seconds", 0.0) + r.get("graph_resume_seconds", 0.0) for r in steady]
    return {"median_seconds": per_phase, "median_step_seconds": _median([r["step_seconds"] for r in steady]),
            "graph_backup_median_seconds": _median(graph),
            "graph_backup_bytes": max((r.get("graph_backup_bytes", 0) for r in records), default=0),
            "graph_backup_share": sum(graph) / step_total if step_total else 0.0,
            "transition_share": transitions / step_total if step_total else 0.0,
            "transition_share_all_steps": everything / sum(r["step_seconds"] for r in records) if records else 0.0,
            "transitions": list(TRANSITIONS)}


def reward_figures(rewards: list[float]) -> dict:
    """The reward's running mean (smoothing.py: the window the reward plot draws too) over the
    first and the last steps, and the step where it first reaches 95 % of the maximum."""
    window = reward_window(len(rewards))
    means = running_mean(rewards, window)
    first, last = (means[0], means[-1]) if means else (0.0, 0.0)
    reached = next((k + window for k, mean in enumerate(means) if mean >= 0.95 * REWARD_MAX), None)
    return {"chance": task.CHANCE, "max": REWARD_MAX, "window": window, "first": first, "last": last,
            "last_share_of_max": last / REWARD_MAX, "reached_95_percent_at_step": reached}


def memory_figures(run, records: list[dict]) -> dict:
    """Sizes of the two phases, the residual after each engine pause, and whether the two
    engines would fit together."""
    if run.device.type != "cuda":
        return {}
    residuals = [r["residual_bytes"] for r in records if "residual_bytes" in r]
    figures: dict = {"capacity_bytes": run.capacity, "baseline_context_bytes": run.baseline,
                     "engine_built_bytes": run.engine_built_bytes, "trainer_need_estimate_bytes": run.trainer_need,
                     "peak_used_bytes": max(y for _, y in run.timeline.samples)}
    if residuals:
        floor = _median(residuals)
        engine = _median([r["rollout_used_bytes"] - r["residual_bytes"] for r in records if "residual_bytes" in r])
        trainer = _median([r["train_used_bytes"] - r["residual_bytes"] for r in records if "residual_bytes" in r])
        need = int(floor + engine + trainer)
        over = [r - run.baseline for r in residuals]
        figures.update({
            "engine_bytes": int(engine), "trainer_bytes": int(trainer), "no_saver_need_bytes": need,
            "fits_without_saver": need <= run.capacity,
            "residual_bytes_per_step": residuals, "residual_over_baseline_max_bytes": max(over),
            # The saver's stray-access scratch (stray_access), within that residual.
            "stray_scratch_bytes": (records[-1].get("residual_breakdown") or {}).get("saver_scratch", 0),
            "residual_over_baseline_median_bytes": int(_median(over)),
            "residual_breakdown_first": records[0].get("residual_breakdown"),
            "residual_breakdown_last": records[-1].get("residual_breakdown"),
            "leftovers_at_start": getattr(run, "first_leftovers", None),
            "leftovers_last_step": records[-1].get("leftovers"),
        })
    return figures


def write_summary(out: Path, run, records: list[dict], ranks: list[dict], startup_seconds: float,
                  total_seconds: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    p = run.preset
    rewards = [r["reward"] for r in records]
    memory = memory_figures(run, records)
    time_figures = timing(records)
    reward = reward_figures(rewards)
    summary = {
        "outcome": "completed", "preset": p.name, "saver": run.saver is not None,
        "hook_mode": None if run.saver is None else run.args.hook_mode, "device": str(run.device),
        "device_name": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
        "world_size": run.world_size, "vocab": p.config.vocab, "dim": p.config.dim, "layers": p.config.layers,
        "parameters": p.config.parameter_count(), "kv_slots": run.kv_slots, "sequences_per_step": p.sequences,
        "micro_batches": p.micro_batches, "completion_length": p.completion, "steps": len(records),
        "startup_seconds": startup_seconds, "total_seconds": total_seconds,
        "reward": reward, "reward_first": reward["first"], "reward_last": reward["last"],
        "time": time_figures, "memory": memory, "ranks": ranks,
        "guard_tolerance": 1e-3,
        "guard_passed_every_step": all(r.get("guard_ok", True) for r in records),
        "records": records,
        # What the memory plot draws, so that write_plots can draw it again from this file.
        "timeline": {"samples": run.timeline.samples, "host_samples": run.timeline.host_samples,
                     "host_budget": run.timeline.host_budget, "spans": run.timeline.spans},
    }
    summary["headline"] = headline(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_plots(summary, out)
    return summary


def plot_title(summary: dict) -> str:
    title = f"{summary['device_name']}, preset {summary['preset']}, saver {summary['hook_mode'] or 'off'}"
    if summary["world_size"] > 1:  # every rank runs the same loop; rank 0 writes what it saw
        title += f", {summary['world_size']} ranks (rank 0's GPU)"
    return title


def write_plots(summary: dict, out: Path) -> list[Path]:
    """memory.png (GPU runs only: on the CPU there is no device memory to show) and reward.png,
    from a completed run's summary alone; returns the pictures written."""
    if summary.get("outcome") != "completed":
        raise ValueError(f"{out / 'summary.json'} is of a run that did not complete "
                         f"({summary.get('outcome')!r}): it has no memory or reward to draw")
    title, written = plot_title(summary), []
    memory, timeline = summary["memory"], summary.get("timeline")
    if memory and timeline:
        memory_plot(timeline["samples"], timeline["host_samples"], timeline["host_budget"], timeline["spans"],
                    memory["capacity_bytes"], memory.get("no_saver_need_bytes"), memory["baseline_context_bytes"],
                    title, out / "memory.png")
        written.append(out / "memory.png")
    reward_plot([r["reward"] for r in summary["records"]], summary["reward"], title, out / "reward.png")
    return [*written, out / "reward.png"]


def replot(out: Path) -> list[Path]:
    """Draws the pictures of the run in `out` again, with today's plots, from its summary.json.
    A summary written before it kept its timeline gets its reward plot only."""
    path = out / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: --replot takes the --out folder of a run")
    return write_plots(json.loads(path.read_text()), out)


def headline(summary: dict) -> str:
    r, t, m = summary["reward"], summary["time"], summary["memory"]
    lines = [f"reward {r['first']:.3f} -> {r['last']:.3f} (chance {r['chance']:.1f}, max {r['max']:.0f}; 95 % of max "
             f"reached at step {r['reached_95_percent_at_step']}); guard passed every step: "
             f"{summary['guard_passed_every_step']}",
             f"step {t['median_step_seconds'] * 1e3:.0f} ms (median): " +
             ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t["median_seconds"].items()) +
             f" ms; transitions {100 * t['transition_share']:.1f} % of the step; "
             f"{summary['total_seconds']:.0f} s in all ({summary['startup_seconds']:.0f} s to start)"]
    if t["graph_backup_bytes"]:
        lines.append(f"graph pool backed up: {t['graph_backup_bytes'] / MiB:.0f} MiB, its pause + resume "
                     f"{t['graph_backup_median_seconds'] * 1e3:.1f} ms a step (median), "
                     f"{100 * t['graph_backup_share']:.2f} % of the step")
    if m.get("engine_bytes") is not None:
        lines.append(f"engine {m['engine_bytes'] / GiB:.1f} GiB + trainer {m['trainer_bytes'] / GiB:.1f} GiB "
                     f"would need {m['no_saver_need_bytes'] / GiB:.1f} GiB of {m['capacity_bytes'] / GiB:.1f}; "
                     f"residual after the engine's pause: baseline {m['baseline_context_bytes'] / MiB:.0f} MiB + "
                     f"{m['residual_over_baseline_max_bytes'] / MiB:.0f} MiB at most, of which the saver's "
                     f"stray-access scratch {m.get('stray_scratch_bytes', 0) / MiB:.0f} MiB")
    for rank in summary["ranks"][1:] if len(summary["ranks"]) > 1 else []:
        over = [x - rank["baseline_bytes"] for x in rank["residual_bytes"] if x is not None]
        if over:
            lines.append(f"rank {rank['rank']}: residual baseline + {max(over) / MiB:.0f} MiB at most")
    return "\n".join(lines)
