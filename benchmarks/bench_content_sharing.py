"""Identical bytes held once per node, decided on the GPU before any copy: several processes
sharing one GPU (as colocated frameworks run them), each pausing --gib GiB of weights for
--cycles cycles, with content sharing off (TMSL_SHARE_BACKUPS=0) and on (the default).

    python benchmarks/bench_content_sharing.py [--processes 4] [--gib 8] [--cycles 3]
        [--scenarios identical,distinct,changed,trained,staggered,budget] [--paused 2] [--rollout 1]

Each process loads its weights inside its backed-up region, as engines do, and runs a first
rollout (--rollout seconds) before its first pause: where it shares, its backups are taken into
the node's store meanwhile, in the background.

Scenarios, each a fresh set of processes and a node ledger (and store) of its own:
- identical: the same weights in every process (data-parallel replicas), all pausing at once;
- staggered: the same, but one process pauses first and the others one after another, each
  once the one before is paused (a replica pausing after another already has);
- distinct: each process its own weights (tensor-parallel shards): nothing to share;
- changed: the same in every process, new every cycle (the weights after a training step);
- trained: each process its own weights, new every cycle (shards after a training step);
- budget: identical, under a node budget of one process's bytes plus 10 %.

Per scenario and cycle: the pause of all processes (from the first start to the last end),
against the time one process's bytes take over the link; the fastest and slowest single pause;
the resume of all, as GB/s summed (they share the link); the node's host memory (the sum of
the processes' PSS growth from /proc, sampled every 0.5 s through every phase: the peak over
the whole run); refusals and spills; content checked bit for bit after every resume. The
pinned link's bandwidth is measured in the same run; the identical-content bar of backups held
once per node (1.1 x one process's bytes + 200 MiB per process) is printed beside the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_node_host_memory import pinned_bandwidth

GiB, MiB = 1 << 30, 1 << 20

WORKER = r"""
import json, os, sys, time
import torch
gib, cycles, go_dir, rank = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
scenario = sys.argv[5]
n = int(gib * (1 << 30))

def barrier(name):  # says it is there, then waits for everyone's go (or its own)
    open(os.path.join(go_dir, f"{name}.{rank}"), "w").close()
    while not any(os.path.exists(os.path.join(go_dir, f"{name}.{go}")) for go in ("go", f"go{rank}")):
        time.sleep(0.0005)

from torch_mem_saver_lite import OutOfMemoryError, saver
torch.cuda.init()
torch.empty(1, device="cuda")
barrier("ready")  # the driver's baseline of this process's host memory
def fill(cycle):
    seed = 1234 + (rank if scenario in ("distinct", "trained") else 0)
    seed += 1000 * cycle if scenario in ("changed", "trained") else 0
    weights.random_(generator=torch.Generator(device="cuda").manual_seed(seed))
    torch.cuda.synchronize()

with saver.region("weights", enable_cpu_backup=True):
    weights = torch.empty(n, dtype=torch.uint8, device="cuda")
    fill(0)  # loaded in their region, as engines load weights
expected = weights.clone()  # (in GPU memory, outside the region: the check costs no host memory)
rows = []
for cycle in range(cycles):
    if scenario in ("changed", "trained") and cycle > 0:
        expected = None  # (GPU memory for one reference at a time)
        fill(cycle)
        expected = weights.clone()
    barrier(f"pause{cycle}")
    refused, paused = 0, False
    start = time.perf_counter()
    while not paused and time.perf_counter() - start < 10:
        try:
            saver.pause("weights")
            paused = True
        except OutOfMemoryError:
            refused += 1
            time.sleep(0.05)
    paused_at = time.perf_counter()
    spilled = saver.host_memory().spilled_bytes
    barrier(f"resume{cycle}")
    resume_start = time.perf_counter()
    if paused:
        saver.resume("weights")
    torch.cuda.synchronize()
    done = time.perf_counter()
    ok = bool(torch.equal(weights, expected))
    rows.append(dict(start=start, end=paused_at, resume_start=resume_start, resume_end=done, refused=refused,
                     paused=paused, spilled=spilled, ok=ok))
    barrier(f"rolled{cycle}")
print(json.dumps(rows), flush=True)
os._exit(0)  # measured and checked: skip the teardown at exit
"""


def pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


class Sampler:
    """The node's host memory (sum of PSS growth) every 0.5 s, and its peak."""

    def __init__(self, pids: list[int], base: dict[int, int]):
        self.pids, self.base, self.peak, self.samples = pids, base, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        now = sum(max(0, pss(pid) - self.base[pid]) for pid in self.pids)
        self.peak, self.samples = max(self.peak, now), self.samples + 1
        return now

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def wait_for(go_dir: str, name: str, ranks: list[int], children: list[subprocess.Popen]) -> None:
    while not all(os.path.exists(os.path.join(go_dir, f"{name}.{r}")) for r in ranks):
        for child in children:
            if child.poll() is not None:
                raise RuntimeError(f"a worker ended early:\n{child.stderr.read()}")
        time.sleep(0.0005)


def go(go_dir: str, name: str, rank: int | None = None) -> None:
    """Lets everyone (or one rank) past barrier `name`."""
    open(os.path.join(go_dir, f"{name}.go" if rank is None else f"{name}.go{rank}"), "w").close()


def run(scenario: str, share: bool, args: argparse.Namespace) -> dict:
    shm = tempfile.mkdtemp(prefix="tmsl-bench-", dir="/dev/shm")
    go_dir = tempfile.mkdtemp(prefix="tmsl-go-")
    # Sharing "on" is the default a user gets (the variable unset: the store is used where
    # another process of the node uses the library, as every scenario's processes do).
    env = {k: v for k, v in os.environ.items() if k != "TMSL_SHARE_BACKUPS"}
    env["TMSL_HOST_LEDGER"] = os.path.join(shm, "ledger")
    if not share:
        env["TMSL_SHARE_BACKUPS"] = "0"
    if scenario == "budget":
        env["TMSL_HOST_MEMORY_BUDGET"] = str(int(1.1 * args.gib * GiB))
    worker = scenario if scenario in ("changed", "trained", "distinct") else "identical"
    children = [subprocess.Popen([sys.executable, "-c", WORKER, str(args.gib), str(args.cycles), go_dir, str(rank),
                                  worker], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank in range(args.processes)]
    ranks = list(range(args.processes))
    wait_for(go_dir, "ready", ranks, children)
    pids = [child.pid for child in children]
    sampler = Sampler(pids, {pid: pss(pid) for pid in pids})
    go(go_dir, "ready")
    for cycle in range(args.cycles):
        if cycle == 0:
            wait_for(go_dir, "pause0", ranks, children)
            time.sleep(args.rollout)  # the first rollout
        wait_for(go_dir, f"pause{cycle}", ranks, children)
        if scenario == "staggered":  # one at a time, each once the one before is paused
            for rank in ranks:
                go(go_dir, f"pause{cycle}", rank)
                wait_for(go_dir, f"resume{cycle}", [rank], children)
        go(go_dir, f"pause{cycle}")
        wait_for(go_dir, f"resume{cycle}", ranks, children)
        time.sleep(args.paused)  # the training phase
        go(go_dir, f"resume{cycle}")
        wait_for(go_dir, f"rolled{cycle}", ranks, children)
        time.sleep(args.rollout)  # the next rollout
        go(go_dir, f"rolled{cycle}")
    outputs = [child.communicate(timeout=300) for child in children]
    sampler.stop()
    subprocess.run(["rm", "-rf", shm, go_dir], check=False)
    rows = []
    for out, err in outputs:
        if not out.strip():
            raise RuntimeError(f"a worker failed:\n{err}")
        rows.append(json.loads(out))
    return dict(rows=rows, peak=sampler.peak, samples=sampler.samples)


def report(scenario: str, share: bool, result: dict, args: argparse.Namespace, link: float) -> list[str]:
    nbytes = int(args.gib * GiB)
    lines = []
    for cycle in range(args.cycles):
        cycle_rows = [rows[cycle] for rows in result["rows"]]
        first, last = min(r["start"] for r in cycle_rows), max(r["end"] for r in cycle_rows)
        all_ms = (last - first) * 1e3
        single_ms = [(r["end"] - r["start"]) * 1e3 for r in cycle_rows]
        # The resumes run at once: GB/s summed over the processes that paused (they share the link).
        resumed = [r for r in cycle_rows if r["paused"]]
        resume_s = max(r["resume_end"] for r in resumed) - min(r["resume_start"] for r in resumed)
        resume_gbs = nbytes * len(resumed) / resume_s / 1e9
        lines.append(
            f"| {scenario} | {'on' if share else 'off'} | {cycle + 1} | {all_ms:.0f} | "
            f"{all_ms / (nbytes / link / 1e6):.2f} | {min(single_ms):.0f} / {max(single_ms):.0f} | "
            f"{nbytes / (min(single_ms) / 1e3) / 1e9 / link:.2f} | {resume_gbs:.1f} ({resume_gbs / link:.0%}) | "
            f"{sum(r['refused'] for r in cycle_rows)} | {max(r['spilled'] for r in cycle_rows) / GiB:.1f} | "
            f"{all(r['ok'] for r in cycle_rows)} |")
    bar = 1.1 * args.gib * GiB + 200 * MiB * args.processes
    lines.append(f"| {scenario} | {'on' if share else 'off'} | peak host memory (sum of PSS, {result['samples']} "
                 f"samples) | **{result['peak'] / GiB:.2f} GiB** | identical bar {bar / GiB:.2f} GiB | | | | | | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--scenarios", default="identical,staggered,distinct,changed,trained,budget")
    parser.add_argument("--sharing", default="off,on", help="off, on or both (off,on)")
    parser.add_argument("--paused", type=float, default=2.0, help="seconds paused each cycle (the training phase)")
    parser.add_argument("--rollout", type=float, default=1.0,
                        help="seconds resident before the first pause and after each resume")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    link = pinned_bandwidth(int(args.gib * GiB)) * 1e9  # bytes/s
    print(f"{torch.cuda.get_device_name()}, {args.processes} processes x {args.gib:g} GiB, {args.cycles} cycles; "
          f"pinned link {link / 1e9:.1f} GB/s (one process's bytes: {args.gib * GiB / link * 1e3:.0f} ms)", flush=True)
    print("| scenario | sharing | cycle | pause of all (ms) | x one's link time | single pause min / max (ms) | "
          "fastest single / link | resume of all GB/s (of the link) | refused | spilled GiB | bit-exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    results = {}
    for scenario in args.scenarios.split(","):
        for sharing in args.sharing.split(","):
            result = run(scenario, sharing == "on", args)
            results[f"{scenario}-{sharing}"] = result
            for line in report(scenario, sharing == "on", result, args, link / 1e9):
                print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
