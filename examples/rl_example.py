"""Colocated RL on one GPU: a rollout engine (decode captured as CUDA graphs) and a trainer
take turns, each paused with torch_mem_saver_lite while the other runs.

    python examples/rl_example.py                       # sized from the GPU: the engines fit only in turns
    python examples/rl_example.py --no-saver            # ... and the same run without the saver runs out of memory
    python examples/rl_example.py --hook-mode preload   # re-executes itself with LD_PRELOAD
    python examples/rl_example.py --preset tiny         # a few MiB, for tests
    python examples/rl_example.py --device cpu          # the learning loop alone (12-token vocabulary)
    torchrun --nproc-per-node 2 examples/rl_example.py  # data-parallel, an engine per rank
    python examples/rl_example.py --replot out/rl       # draw a run's plots again from its summary.json

Each step (GRPO): the engine generates groups of completions for counting prompts, which are
scored. The engine is paused (weights, KV cache, graph pool) and torch's cached blocks given
back; the trainer's state is resumed from pinned host memory, it takes an optimizer step, and
it is paused again with the leftovers of the step released (NCCL communicators suspended).
The engine resumes, the new weights are copied into it in place from the trainer's host
backup, and one decode step through the graph is checked against the same step run eagerly.
Writes <out>/summary.json, <out>/memory.png and <out>/reward.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
# NCCL must not register graph-captured buffers whose memory a pause replaces; it reads this
# once, so it is set before torch.distributed can start NCCL.
os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from rl import leftovers, task  # noqa: E402
from rl.engine import RolloutEngine  # noqa: E402
from rl.grpo import group_advantages  # noqa: E402
from rl.presets import Preset, kv_slots_for, learning_preset, with_vocabulary_for  # noqa: E402
from rl.progress import Progress  # noqa: E402
from rl.summary import OutOfMemory, replot, write_out_of_memory, write_summary  # noqa: E402
from rl.timeline import Timeline, transition_share, used_bytes  # noqa: E402
from rl.trainer import Trainer, warmup_cosine  # noqa: E402

GiB = 1 << 30
GUARD_TOLERANCE = 1e-3  # fp32 hidden states, graph vs eager: the same kernels, rounding aside
ENGINE_TAGS = ["weights", "kv_cache", "cuda_graph"]
GRAPH_TAG = "cuda_graph"  # the one part of the engine backed up at a pause (graph pools are, by default)


def reexec_with_preload() -> None:
    """Preload mode needs the library in LD_PRELOAD from the start: run again with it."""
    from torch_mem_saver_lite import _lib, configure_subprocess

    if _lib.library_path() in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        return  # this is the re-executed process
    with configure_subprocess():
        env = dict(os.environ)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def no_gpu_message(cuda_build: str | None) -> str:
    """What a run without a usable GPU says; `cuda_build` is torch.version.cuda (None for a
    CPU build of torch, which never sees a GPU, driver or not)."""
    message = ("no CUDA GPU available: the RL example needs an NVIDIA GPU and its driver "
               "(run `python -m torch_mem_saver_lite` to see what is missing)")
    if cuda_build is None:
        message += (f"\nthis torch ({torch.__version__}) is a CPU build: install a CUDA build, e.g. "
                    "`pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu128` "
                    "(https://pytorch.org/get-started/locally/ lists the others)")
    return message + (
        "\nwhat runs here without a GPU: the learning loop alone, on the CPU (`python examples/rl_example.py "
        "--device cpu --preset tiny --steps 300`: it learns to count in a few minutes), and the saver over host "
        "memory, which `make test` runs: `torch_mem_saver_lite.testing.HostSaver` pauses and resumes host "
        "allocations as the CUDA backend does device ones (docs/guide.md, \"Testing without a GPU\")")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Colocated RL with torch_mem_saver_lite")
    parser.add_argument("--preset", choices=["tiny", "default"], default="default")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    parser.add_argument("--micro-batches", type=int,
                        help="split each step's batch this many ways (default: the preset's); more gives "
                             "each step more work for the same memory, so transitions take a smaller share")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-saver", action="store_true", help="same loop without pausing anything")
    parser.add_argument("--hook-mode", choices=["torch", "preload"], default="torch")
    parser.add_argument("--out", default="out/rl", help="folder for summary.json, memory.png and reward.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the learning loop alone, without the saver, graphs or sizing (for tests)")
    parser.add_argument("--replot", metavar="OUT",
                        help="run nothing: draw memory.png and reward.png in OUT again from its summary.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.replot:  # needs no GPU: everything the pictures show is in the summary
        try:
            written = replot(Path(args.replot))
        except (OSError, ValueError) as error:
            print(f"--replot: {error}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}")
        if all(path.name != "memory.png" for path in written):
            print("no memory.png: a CPU run, or a summary written before summaries kept the memory timeline")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(no_gpu_message(torch.version.cuda), file=sys.stderr)
        return 1
    if args.device == "cpu":
        args.no_saver = True
    if args.hook_mode == "preload" and not args.no_saver:
        reexec_with_preload()
    try:
        return Run(args).run()
    except OutOfMemory as failure:
        print(failure.explain(), file=sys.stderr)
        write_out_of_memory(Path(args.out), failure)
        return 3



def move_engine(pause_or_resume, record: dict, key: str) -> None:
    """Pauses or resumes the engine's tags; the graph pool in a call of its own, timed into
    record[key], so the summary can say what backing it up adds to a step."""
    pause_or_resume([tag for tag in ENGINE_TAGS if tag != GRAPH_TAG])
    start = time.perf_counter()
    pause_or_resume(GRAPH_TAG)
    record[key] = time.perf_counter() - start

class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.distributed = self.world_size > 1
        if args.device == "cuda":
            index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device("cpu")
        self.saver = None
        if not args.no_saver:
            from torch_mem_saver_lite import saver

            saver.hook_mode = args.hook_mode
            self.saver = saver
        self.timeline = Timeline(self.device)
        self.groups = None

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    # ----- set-up -----------------------------------------------------------------------------------
    def measure_baseline(self) -> None:
        """The bare CUDA context, before any model or NCCL: what a pause should get back to."""
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)
        self.baseline = self.timeline.sample()
        self.baseline_breakdown = leftovers.breakdown(self.saver, self.device)  # also records the saver's
        if self.device.type == "cuda":
            self.free0, self.capacity = torch.cuda.mem_get_info(self.device)
        else:
            self.free0, self.capacity = 0, 0

    def start_distributed(self) -> None:
        if not self.distributed:
            return
        device_id = self.device if self.device.type == "cuda" else None
        torch.distributed.init_process_group("nccl" if device_id is not None else "gloo", device_id=device_id)
        self.groups = [torch.distributed.group.WORLD]

    def choose_preset(self) -> Preset:
        preset = learning_preset(self.args.preset)
        if self.args.steps:
            preset = dataclasses.replace(preset, steps=self.args.steps)
        if self.args.micro_batches:
            preset = dataclasses.replace(preset, micro_batches=self.args.micro_batches)
        if preset.name == "default" and self.device.type == "cuda":
            preset = with_vocabulary_for(preset, self.capacity)
        return preset

    def build(self) -> None:
        p = self.preset = self.choose_preset()
        self.batch_sizes = [1 << i for i in range((p.decode_batch - 1).bit_length() + 1)]
        lr_factor = warmup_cosine(p.warmup, p.steps) if p.warmup else None
        self.trainer = Trainer(p.config, p.lr, self.device, self.saver, self.distributed, seed=self.args.seed,
                               lr_factor=lr_factor)
        self.trainer_need = self.trainer.state_bytes()
        kv_slots = None
        if p.name == "default" and self.device.type == "cuda":
            probe = torch.randint(0, task.DIGITS, (p.sequences, task.PROMPT_LENGTH + p.completion), device=self.device)
            self.trainer_need += self.trainer.activation_peak_bytes(probe, task.PROMPT_LENGTH, p.micro_batches)
            del probe
            kv_slots = kv_slots_for(p, self.batch_sizes[-1], self.free0, self.capacity, self.trainer_need)
        initial = {k: v.detach().to("cpu", copy=True) for k, v in self.trainer.weights().items()}
        if self.saver is not None:
            self.saver.pause("train")  # the engine is built while the training state is off the GPU
        before = used_bytes(self.device)
        self.engine = RolloutEngine(p.config, initial, self.batch_sizes, task.PROMPT_LENGTH, p.completion,
                                    self.device, self.saver, kv_slots=kv_slots)
        self.engine_built_bytes = self.timeline.sample() - before
        self.kv_slots = self.engine.kv_cache.shape[2]
        del initial
        self.say(f"preset {p.name}: vocabulary {p.config.vocab:,} ({task.VOCAB} used by the task), "
                 f"{p.config.parameter_count() / 1e6:.1f}M parameters, {p.sequences} sequences a step in "
                 f"{p.micro_batches} micro-batch(es), KV cache for {self.kv_slots:,} sequences; "
                 f"engine {self.engine_built_bytes / GiB:.1f} GiB + rollout, training step "
                 f"{self.trainer_need / GiB:.1f} GiB, GPU {self.capacity / GiB:.1f} GiB; saver "
                 f"{'off' if self.saver is None else self.args.hook_mode}")

    # ----- one step -------------------------------------------------------------------------------------
    def step(self, number: int, prompt_generator: torch.Generator, generator: torch.Generator) -> dict:
        p, saver, phase = self.preset, self.saver, self.timeline.phase
        seconds: dict[str, float] = {}
        record: dict = {"step": number, "seconds": seconds}
        with phase("rollout", seconds):
            prompts = task.make_prompts(p.prompts, prompt_generator, self.device).repeat_interleave(p.group, dim=0)
            completions = torch.cat([self.engine.generate(chunk, self.args.temperature, generator)
                                     for chunk in prompts.split(p.decode_batch)])
            reward = task.rewards(prompts, completions)
            advantages = group_advantages(reward, p.group)
            sequences = torch.cat([prompts, completions], dim=1)
        record["rollout_used_bytes"] = self.timeline.samples[-1][1]
        if saver is not None:
            with phase("engine_pause", seconds):
                move_engine(saver.pause, record, "graph_pause_seconds")
                record["graph_backup_bytes"] = saver.stats()[GRAPH_TAG].host_backup_bytes
                # The rollout's temporaries (logits) and workspaces; NCCL stays up for training.
                leftovers.release(saver, self.device, process_groups=[])
            record["residual_bytes"] = self.timeline.samples[-1][1]
            record["residual_breakdown"] = leftovers.breakdown(saver, self.device)
            with phase("trainer_resume", seconds):
                leftovers.restore(saver)  # NCCL back for the gradient all-reduce
                saver.resume("train")
        with phase("train", seconds):
            try:
                record["loss"] = self.trainer.step(sequences, task.PROMPT_LENGTH, advantages, p.micro_batches)
            except torch.OutOfMemoryError as error:
                raise self.out_of_memory(number, error) from error
        record["train_used_bytes"] = self.timeline.samples[-1][1]
        if saver is not None:
            with phase("trainer_pause", seconds):
                saver.pause("train")  # to pinned host memory, before the engine needs the GPU back
                record["leftovers"] = leftovers.release(saver, self.device, self.groups)
            with phase("engine_resume", seconds):
                move_engine(saver.resume, record, "graph_resume_seconds")
        with phase("weight_sync", seconds):
            # New weights go into the engine's own tensors in place: the graphs keep their
            # addresses. With the saver they come from the trainer's pinned host backup, so
            # trainer and engine never need the GPU at the same time.
            if saver is not None:
                self.engine.load_weights({name: saver.get_cpu_backup(w, zero_copy=True)
                                          for name, w in self.trainer.weights().items()})
            else:
                self.engine.load_weights(self.trainer.weights())
        if self.device.type == "cuda":
            with phase("guard", seconds):
                record["guard_max_diff"] = self.engine.graph_vs_eager(prompts[:1])
            record["guard_ok"] = record["guard_max_diff"] <= GUARD_TOLERANCE
        record["reward"] = float(reward.mean())
        record["step_seconds"] = sum(v for k, v in seconds.items() if k != "guard")
        record["transition_share"] = transition_share(seconds, record["step_seconds"])
        return record

    def out_of_memory(self, number: int, error: Exception) -> OutOfMemory:
        return OutOfMemory(step=number, capacity=self.capacity, baseline=self.baseline,
                           engine=self.engine_built_bytes, trainer=self.trainer_need,
                           message=str(error).splitlines()[0], preset=self.preset.name, vocab=self.preset.config.vocab,
                           saver=self.saver is not None)

    # ----- the run ----------------------------------------------------------------------------------------
    def run(self) -> int:
        self.measure_baseline()
        self.start_distributed()
        self.build()
        if self.saver is not None:
            # Off the GPU during rollouts: the caching allocator's leftovers and NCCL.
            self.first_leftovers = leftovers.release(self.saver, self.device, self.groups)
        ready = time.perf_counter()
        self.timeline.sample()
        generator = torch.Generator(device=self.device).manual_seed(self.args.seed + 1000 * self.rank)
        prompt_generator = torch.Generator().manual_seed(self.args.seed + 1000 * self.rank)
        progress = Progress(self.preset.steps, enabled=self.rank == 0)
        records = []
        for number in range(1, self.preset.steps + 1):
            record = self.step(number, prompt_generator, generator)
            records.append(record)
            progress.update(number, record["reward"], record["transition_share"], record["train_used_bytes"] / GiB)
            if not record.get("guard_ok", True):
                progress.close()
                print(f"graph replay disagrees with eager decode after resume: max |diff| "
                      f"{record['guard_max_diff']:.3g} > {GUARD_TOLERANCE}", file=sys.stderr)
                return 2
        progress.close()
        leftovers.restore(self.saver)  # NCCL back for the gather below and a clean exit
        ranks = self.gather_ranks(records)
        if self.rank == 0:
            summary = write_summary(Path(self.args.out), self, records, ranks,
                                    startup_seconds=ready - STARTED, total_seconds=time.perf_counter() - STARTED)
            self.say(summary["headline"])
        if self.distributed:
            torch.distributed.destroy_process_group()
        return 0

    def gather_ranks(self, records: list[dict]) -> list[dict]:
        """Each rank's residual after the engine's pause (rank 0 writes them all)."""
        mine = {"rank": self.rank, "device": str(self.device), "baseline_bytes": self.baseline,
                "residual_bytes": [r.get("residual_bytes") for r in records],
                "last_breakdown": records[-1].get("residual_breakdown") if records else None}
        if not self.distributed:
            return [mine]
        everyone: list = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, mine)
        return everyone


if __name__ == "__main__":
    sys.exit(main())
