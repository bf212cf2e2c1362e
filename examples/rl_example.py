"""Colocated RL on one GPU: a rollout engine (decode captured as CUDA graphs) and a trainer
take turns, each paused with torch_mem_saver_lite while the other runs.

    python examples/rl_example.py                          # default preset, under a minute
    python examples/rl_example.py --preset large           # only fits with the saver
    python examples/rl_example.py --preset large --no-saver   # ... and fails without it
    python examples/rl_example.py --hook-mode preload      # re-executes itself with LD_PRELOAD
    torchrun --nproc-per-node 2 examples/rl_example.py     # data-parallel, an engine per rank

Each step (GRPO): generate groups of completions for counting prompts, score them, then
`with saver.paused(["weights", "kv_cache", "cuda_graph"])`: resume the trainer's state,
take an optimizer step, pause the trainer again (its state goes to pinned host memory).
Once the engine is back, push the new weights into it in place from the trainer's host
backup, and check one decode step through the graph against the same step run eagerly.
Writes <out>/summary.json and <out>/memory.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

# NCCL must not register graph-captured buffers whose memory a pause replaces; it reads this
# once, so it is set before torch.distributed can start NCCL.
os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from rl import task  # noqa: E402
from rl.engine import RolloutEngine  # noqa: E402
from rl.grpo import group_advantages  # noqa: E402
from rl.model import ModelConfig  # noqa: E402
from rl.trainer import Trainer  # noqa: E402

GiB = 1 << 30
GUARD_TOLERANCE = 1e-3  # fp32 logits, graph vs eager: the same kernels, rounding aside
INFERENCE_TAGS = ["weights", "kv_cache", "cuda_graph"]


def preset(name: str, total_memory: int) -> dict:
    """Model and rollout sizes for a preset."""
    completion = 6
    if name == "tiny":
        # Learns to count (reward 0.86-0.99 over the last 50 of 300 steps, 10 seeds on the CPU).
        return dict(config=ModelConfig(task.VOCAB, dim=64, layers=2, heads=2, max_seq=16), steps=3,
                    prompts=8, group=8, completion=completion, lr=1e-3)
    if name == "default":
        return dict(config=ModelConfig(task.VOCAB, dim=256, layers=4, heads=4, max_seq=16), steps=200,
                    prompts=4, group=8, completion=completion, lr=1e-3)
    if name == "large":
        # Trainer state (weights, grads, two AdamW moments: 16 bytes a parameter) about 35 % of
        # the GPU, the KV cache about 70 %: each phase fits alone, both together do not.
        dim = 4096
        layers = max(1, int(0.35 * total_memory / (16 * 12 * dim * dim)))
        kv_per_position = layers * 2 * 32 * dim * 4
        max_seq = max(16, int(0.70 * total_memory / kv_per_position) // 16 * 16)
        return dict(config=ModelConfig(task.VOCAB, dim=dim, layers=layers, heads=32, max_seq=max_seq),
                    steps=3, prompts=4, group=8, completion=completion, lr=1e-5)
    raise ValueError(f"unknown preset {name!r}")


class Timeline:
    """GPU memory in use over time, tagged by phase, for the plot."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()
        self.points: list[tuple[float, float, str]] = []

    def used(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def mark(self, phase: str) -> int:
        used = self.used()
        self.points.append((time.perf_counter() - self.start, used / GiB, phase))
        return used


class Phases:
    """Wall time per phase of one step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def engine_paused(saver, phases: Phases, record: dict, timeline: Timeline):
    """`saver.paused(INFERENCE_TAGS)`, with the pause and the resume timed and measured."""
    if saver is None:
        yield
        return
    stats = saver.stats()
    record["inference_bytes"] = sum(stats[t].reserved_bytes for t in INFERENCE_TAGS)
    before = timeline.used()
    with phases("pause"):
        saver.pause(INFERENCE_TAGS)
    record["released_at_pause_bytes"] = before - timeline.used()
    try:
        yield
    finally:
        with phases("resume"):
            saver.resume(INFERENCE_TAGS)


def progress(step: int, steps: int, reward: float, phases: Phases, used_gib: float) -> None:
    done = int(30 * step / steps)
    times = " ".join(f"{k} {v * 1e3:.0f}ms" for k, v in phases.seconds.items())
    print(f"[{'#' * done}{'.' * (30 - done)}] step {step}/{steps} reward {reward:.3f} | {times} | "
          f"GPU {used_gib:.2f} GiB", flush=True)


def plot(timeline: Timeline, rewards: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, reward) = plt.subplots(1, 2, figsize=(13, 4))
    colors = {"rollout": "tab:blue", "train": "tab:orange", "sync": "tab:green", "paused-engine": "tab:red",
              "start": "tab:gray"}
    xs = [p[0] for p in timeline.points]
    ys = [p[1] for p in timeline.points]
    memory.step(xs, ys, where="post", color="black", linewidth=0.8)
    for t, used, phase in timeline.points:
        memory.scatter([t], [used], color=colors.get(phase, "tab:gray"), s=12, label=phase)
    handles = {h.get_label(): h for h in memory.collections}
    memory.legend(handles.values(), handles.keys(), fontsize=8)
    memory.set_xlabel("seconds")
    memory.set_ylabel("GPU memory in use (GiB)")
    memory.set_title("memory by phase")
    reward.plot(range(1, len(rewards) + 1), rewards, alpha=0.4, label="per step")
    window = max(1, len(rewards) // 20)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    reward.plot(range(1, len(rewards) + 1), smooth, label=f"mean of {window}")
    reward.legend(fontsize=8)
    reward.set_xlabel("step")
    reward.set_ylabel("mean reward")
    reward.set_title("reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def reexec_with_preload() -> None:
    """Preload mode needs the library in LD_PRELOAD from the start: run again with it."""
    from torch_mem_saver_lite import _lib, configure_subprocess

    if _lib.library_path() in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        return  # this is the re-executed process
    with configure_subprocess():
        env = dict(os.environ)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> int:
    try:
        return run()
    except torch.OutOfMemoryError as error:
        print(f"out of GPU memory: {str(error).splitlines()[0]}\n(--preset large needs the saver: "
              "its rollout and training phases do not fit on the GPU together)", file=sys.stderr)
        return 3


def run() -> int:
    parser = argparse.ArgumentParser(description="Colocated RL with torch_mem_saver_lite")
    parser.add_argument("--preset", choices=["tiny", "default", "large"], default="default")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-saver", action="store_true", help="same loop without pausing anything")
    parser.add_argument("--hook-mode", choices=["torch", "preload"], default="torch")
    parser.add_argument("--out", default="out/rl", help="folder for summary.json and memory.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the learning loop alone, without the saver or graphs (for tests)")
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU available: the RL example needs an NVIDIA GPU and its driver "
              "(run `python -m torch_mem_saver_lite` to see what is missing)", file=sys.stderr)
        return 1
    if args.device == "cpu":
        args.no_saver = True
    if args.hook_mode == "preload" and not args.no_saver:
        reexec_with_preload()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    if distributed:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(args.device, torch.cuda.current_device() if args.device == "cuda" else None)

    saver = None
    if not args.no_saver:
        from torch_mem_saver_lite import saver

        saver.hook_mode = args.hook_mode
    total_memory = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else 8 * GiB
    p = preset(args.preset, total_memory)
    steps = args.steps or p["steps"]
    config: ModelConfig = p["config"]
    sequences_per_step = p["prompts"] * p["group"]
    # Decode graphs for 1, 2, 4, ... up to the first power of two that holds a whole step.
    batch_sizes = [1 << i for i in range(max(5, (sequences_per_step - 1).bit_length()) + 1)]
    timeline = Timeline(device)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank)
    prompt_generator = torch.Generator().manual_seed(args.seed + 1000 * rank)
    if rank == 0:
        print(f"preset {args.preset}: {config.parameter_count() / 1e6:.1f}M parameters, max_seq "
              f"{config.max_seq}, {sequences_per_step} sequences/step, saver "
              f"{'off' if saver is None else args.hook_mode}", flush=True)

    trainer = Trainer(config, p["lr"], device, saver, distributed, seed=args.seed)
    initial = {k: v.detach().to("cpu", copy=True) for k, v in trainer.weights().items()}
    if saver is not None:
        saver.pause("train")  # the engine is built while the training state is off the GPU
    engine = RolloutEngine(config, initial, batch_sizes, task.PROMPT_LENGTH, p["completion"], device, saver)
    del initial
    timeline.mark("start")

    records, rewards_per_step = [], []
    for step in range(1, steps + 1):
        phases = Phases()
        record: dict = {"step": step}
        with phases("rollout"):
            prompts = task.make_prompts(p["prompts"], prompt_generator, device)
            prompts = prompts.repeat_interleave(p["group"], dim=0)
            completions = engine.generate(prompts, args.temperature, generator)
            reward = task.rewards(prompts, completions)
            advantages = group_advantages(reward, p["group"])
        record["rollout_used_bytes"] = timeline.mark("rollout")
        sequences = torch.cat([prompts, completions], dim=1)

        with engine_paused(saver, phases, record, timeline):
            timeline.mark("paused-engine")
            with phases("train"):
                if saver is not None:
                    saver.resume("train")
                record["loss"] = trainer.step(sequences, task.PROMPT_LENGTH, advantages)
            record["train_used_bytes"] = timeline.mark("train")
            if saver is not None:
                record["train_resident_bytes"] = saver.stats()["train"].resident_bytes
                with phases("pause-train"):
                    saver.pause("train")  # to host memory, before the engine needs the GPU back
        with phases("sync"):
            # New weights go into the engine's own tensors in place: the graphs keep their
            # addresses. With the saver they come from the trainer's pinned host backup, so
            # trainer and engine never need the GPU at the same time.
            if saver is not None:
                engine.load_weights({name: saver.get_cpu_backup(p, zero_copy=True)
                                     for name, p in trainer.weights().items()})
            else:
                engine.load_weights(trainer.weights())
        timeline.mark("sync")
        if device.type == "cuda":
            record["guard_max_diff"] = engine.graph_vs_eager(prompts[:1])
            record["guard_ok"] = record["guard_max_diff"] <= GUARD_TOLERANCE
            if not record["guard_ok"]:
                print(f"graph replay disagrees with eager decode after resume: max |diff| "
                      f"{record['guard_max_diff']:.3g} > {GUARD_TOLERANCE}", file=sys.stderr)
                return 2
        record["reward"] = float(reward.mean())
        record["seconds"] = dict(phases.seconds)
        rewards_per_step.append(record["reward"])
        records.append(record)
        if rank == 0:
            progress(step, steps, record["reward"], phases, record["train_used_bytes"] / GiB)

    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        window = max(1, min(10, steps // 3))
        summary = {
            "preset": args.preset, "hook_mode": None if saver is None else args.hook_mode,
            "saver": saver is not None, "device": str(device), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "parameters": config.parameter_count(), "max_seq": config.max_seq, "steps": steps,
            "reward_first": sum(rewards_per_step[:window]) / window,
            "reward_last": sum(rewards_per_step[-window:]) / window,
            "peak_used_bytes": max(int(pt[1] * GiB) for pt in timeline.points),
            "guard_tolerance": GUARD_TOLERANCE,
            "guard_passed_every_step": all(r.get("guard_ok", True) for r in records),
            "records": records,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        plot(timeline, rewards_per_step, out / "memory.png")
        print(f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; peak GPU memory "
              f"{summary['peak_used_bytes'] / GiB:.2f} GiB; wrote {out / 'summary.json'} and {out / 'memory.png'}")
    if distributed:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
