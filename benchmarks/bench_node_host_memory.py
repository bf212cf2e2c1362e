"""Host memory of a node: several processes sharing one GPU (as colocated frameworks run
them), each pausing and resuming its own copy of the same weights at once, under one node
budget; and one process cycling several backed-up tags in turn.

    python benchmarks/bench_node_host_memory.py [--processes 4] [--gib 2] [--cycles 3]
        [--tms-path DIR] [--disk-dir DIR] [--share] [--rollout 0.5]

Table 1, per budget (room for all backups, and less than that): each cycle's pause and
resume as GB/s summed over the processes, against the pinned copy bandwidth measured in the
same run; the most host memory the node held while paused (the sum of the processes' PSS
growth from /proc, and the ledger's figure) against the budget; pauses refused for want of
room (each then retried after the others resumed); content checked bit for bit after every
resume. With --disk-dir (a directory on a real disk), the smaller budget runs again with the
disk tier: what the budget cannot hold goes to files there (the "on disk" column), against the
disk's own write and read speed measured in the same run (processes pausing at one moment
each wait up to 2 s for the others' caches, then send all their backups to disk). With
--share, the larger budget runs again with TMSL_SHARE_BACKUPS=1: the identical weights held
once by the node (host held is the sum of PSS, which splits shared pages between their
holders). With --distinct, each process's weights differ (nothing to share: what sharing
costs). With --tms-path,
torch_memory_saver (no budget) runs the same processes beside it. Each engine works for
--rollout seconds before its first pause and after each resume (its rollout: where the
library sets host memory for the next pause aside, in the background), outside the timings.

Table 2: one process, three tags of --gib each, paused and resumed one after another for
--cycles rounds: GB/s of each pause against the link (the host cache keeps as many backups
as fit in its budget; a pause that finds it full takes the cached memory of a tag of the same
shape); then 4096 allocations of 2 MiB without backup, timed in that process and in a fresh
one. With --tms-path, torch_memory_saver's rows beside.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from support.ledger import held_bytes

GiB = 1 << 30

WORKER = r"""
import json, os, sys, time
sys.path[:0] = [p for p in os.environ.get("BENCH_EXTRA_PATH", "").split(":") if p]
import torch
tool, gib, cycles, go_dir, rank = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rollout = float(sys.argv[6])
n = int(gib * (1 << 30))

def checksum(t):  # in pieces: a sum over the whole tensor as int64 would take 8 times its size
    return sum(int(t[i:i + (1 << 28)].sum(dtype=torch.int64)) for i in range(0, t.numel(), 1 << 28))

def pss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Pss:"))

def barrier(name):
    open(os.path.join(go_dir, f"{name}.{rank}"), "w").close()
    while not os.path.exists(os.path.join(go_dir, f"{name}.go")):
        time.sleep(0.001)

if tool == "ours":
    from torch_mem_saver_lite import OutOfMemoryError, saver
    region, pause, resume = saver.region, saver.pause, saver.resume
    refusal = OutOfMemoryError
else:
    from torch_memory_saver import torch_memory_saver as saver
    saver.hook_mode = "torch"
    region, pause, resume = saver.region, saver.pause, saver.resume
    refusal = RuntimeError
base = pss()  # before the region: host memory set aside for its backups when it closes counts too
with region("weights", enable_cpu_backup=True):
    weights = torch.empty(n, dtype=torch.uint8, device="cuda")
# The same weights in every process: a seeded pattern, regenerated to check.
seed = 1234 + (rank if os.environ.get("BENCH_DISTINCT") == "1" else 0)
weights.random_(generator=torch.Generator(device="cuda").manual_seed(seed))  # in place: no temporaries
expected = checksum(weights), weights[::4097].clone()
torch.cuda.synchronize()
time.sleep(rollout)  # the engine's first rollout
rows = []
for cycle in range(cycles):
    barrier(f"pause{cycle}")
    refused, paused, spilled = 0, False, 0
    start = time.perf_counter()
    while not paused and time.perf_counter() - start < 3:  # then it stays resident: the engine keeps its GPU
        try:
            pause("weights")
            paused = True
        except refusal:
            refused += 1
            time.sleep(0.05)
    paused_at = time.perf_counter()
    if tool == "ours" and os.environ.get("TMSL_SHARE_BACKUPS") == "1":
        saver.wait_for_released_backups()  # shared in the background after the pause
    held = pss() - base
    if tool == "ours":
        spilled = saver.host_memory().spilled_bytes
    barrier(f"resume{cycle}")
    resume_start = time.perf_counter()
    if paused:
        resume("weights")
    torch.cuda.synchronize()
    done = time.perf_counter()
    ok = checksum(weights) == expected[0] and torch.equal(weights[::4097], expected[1])
    rows.append(dict(pause_start=start, pause_end=paused_at, resume_s=done - resume_start, held=held, refused=refused,
                     paused=paused, spilled=spilled, ok=bool(ok)))
    time.sleep(rollout)  # its next rollout
print(json.dumps(rows), flush=True)
os._exit(0)  # measured and checked: skip the tools' teardown at exit
"""


def pinned_bandwidth(nbytes: int) -> float:
    """Pinned device-to-host copy bandwidth (GB/s): the link's limit for a pause."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start) / 1e9


def disk_bandwidth(directory: str, nbytes: int = 1 << 30) -> tuple[float, float]:
    """Write and read GB/s of one file in ``directory`` with O_DIRECT, 64 MiB at a time (the
    disk tier's own limit)."""
    import mmap

    chunk = 64 << 20
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(4096) * (chunk // 4096))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"bench-disk-{os.getpid()}.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:  # a file system without O_DIRECT: through the page cache, as the library falls back
        fd = os.open(path, flags, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwrite(fd, buffer, offset)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.preadv(fd, [buffer], offset)
        read = nbytes / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read


def ledger_peak(path: Path, stop: list[bool], out: list[int]) -> None:
    while not stop[0]:
        out.append(held_bytes(path))
        time.sleep(0.002)


def run_node(tool: str, processes: int, gib: float, cycles: int, rollout: float, budget: int | None,
             extra_path: str, disk_dir: str | None = None, share: bool = False) -> dict:
    go_dir = tempfile.mkdtemp(prefix="node-bench-")
    ledger = Path(go_dir) / "host-memory.ledger"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TMSL_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR", "TMSL_SHARE_BACKUPS")}
    if share:
        env["TMSL_SHARE_BACKUPS"] = "1"
    env.update(BENCH_EXTRA_PATH=extra_path, TMSL_HOST_LEDGER=str(ledger))
    if disk_dir is not None:
        env["TMSL_DISK_BACKUP_DIR"] = disk_dir
    if budget is not None:
        env["TMSL_HOST_MEMORY_BUDGET"] = str(budget)
    children = [subprocess.Popen([sys.executable, "-c", WORKER, tool, str(gib), str(cycles), go_dir, str(rank),
                                  str(rollout)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for rank in range(processes)]
    try:
        return drive(children, ledger, go_dir, tool, processes, gib, cycles)
    finally:
        for child in children:  # a failed run leaves no worker holding the GPU
            if child.poll() is None:
                child.kill()
                child.wait()


def drive(children, ledger: Path, go_dir: str, tool: str, processes: int, gib: float, cycles: int) -> dict:
    import threading

    samples: list[int] = []
    stop = [False]
    watcher = threading.Thread(target=ledger_peak, args=(ledger, stop, samples), daemon=True)
    if tool == "ours":
        watcher.start()
    for cycle in range(cycles):
        for name in (f"pause{cycle}", f"resume{cycle}"):
            while sum(1 for f in os.listdir(go_dir) if f.startswith(name + ".")) < processes:
                if any(c.poll() not in (None, 0) for c in children):
                    raise RuntimeError("a worker failed: " + "".join(c.stderr.read() for c in children if c.poll()))
                time.sleep(0.002)
            open(os.path.join(go_dir, f"{name}.go"), "w").close()
    outputs = [c.communicate(timeout=600) for c in children]
    stop[0] = True
    return summarise(children, outputs, processes, gib, cycles, samples)


def summarise(children, outputs, processes: int, gib: float, cycles: int, samples: list[int]) -> dict:
    if any(c.returncode != 0 for c in children):
        raise RuntimeError(f"a worker failed ({[c.returncode for c in children]}): " +
                           "".join(out[-2000:] + err[-3000:] for out, err in outputs))
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    cycles_out = []
    for cycle in range(cycles):
        per = [r[cycle] for r in rows]
        moved = [p for p in per if p["paused"]]
        span = max(p["pause_end"] for p in moved) - min(p["pause_start"] for p in moved) if moved else 0
        cycles_out.append(dict(
            paused=len(moved),
            pause_gbs=len(moved) * gib * GiB / span / 1e9 if span else 0.0,
            resume_gbs=len(moved) * gib * GiB / max(p["resume_s"] for p in moved) / 1e9 if moved else 0.0,
            held=sum(p["held"] for p in per), refused=sum(p["refused"] for p in per),
            spilled=sum(p["spilled"] for p in per),
            ok=all(p["ok"] for p in per)))
    return dict(cycles=cycles_out, ledger_peak=max(samples) if samples else None)


def run_sequence(tool: str, gib: float, cycles: int, rollout: float, extra_path: str) -> dict:
    """One process, three backed-up tags cycled in turn: GB/s of each pause, per round; then
    4096 x 2 MiB allocated in a region without backup, in that process and in a fresh one (ms)."""
    code = textwrap.dedent(f"""
        import json, os, sys, time
        sys.path[:0] = [p for p in {extra_path!r}.split(":") if p]
        import torch
        if {tool!r} == "ours":
            from torch_mem_saver_lite import saver
        else:
            from torch_memory_saver import torch_memory_saver as saver
            saver.hook_mode = "torch"
        n = int({gib} * (1 << 30))

        def allocate_without_backup(tag):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with saver.region(tag):
                blocks = [torch.empty(2 << 20, dtype=torch.uint8, device="cuda") for _ in range(4096)]
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3, blocks

        if sys.argv[1] == "fresh":
            ms, blocks = allocate_without_backup("fresh")
            print(json.dumps(dict(fresh_ms=ms)), flush=True)
            os._exit(0)  # measured: skip the tools' teardown (torch_memory_saver refuses frees outside regions)
        tensors = {{}}
        for tag in ("a", "b", "c"):
            with saver.region(tag, enable_cpu_backup=True):
                tensors[tag] = torch.full((n,), ord(tag), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        time.sleep({rollout})  # the first rollout
        rounds = []
        for _ in range({cycles}):
            speeds = []
            for tag in ("a", "b", "c"):
                torch.cuda.synchronize()
                start = time.perf_counter()
                saver.pause(tag)
                speeds.append(n / (time.perf_counter() - start) / 1e9)
                time.sleep(0.3)
                saver.resume(tag)
                assert bool((tensors[tag] == ord(tag)).all())
                time.sleep({rollout})  # its engine's next rollout
            rounds.append(speeds)
        ms, blocks = allocate_without_backup("after")
        out = dict(rounds=rounds, after_ms=ms)
        if {tool!r} == "ours":  # the same again once the host cache (page-locked memory) is given back
            saver.release_host_cache()
            saver.wait_for_released_backups()
            out["after_release_ms"], more = allocate_without_backup("after release")
        print(json.dumps(out), flush=True)
        os._exit(0)
    """)
    out: dict = {}
    for mode in ("sequence", "fresh"):
        result = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-3000:])
        out.update(json.loads(result.stdout.strip().splitlines()[-1]))
    return out


def node_table(args: argparse.Namespace, link: float, need: int) -> None:
    """Table 1: the processes together, per budget and tool."""
    if args.disk_dir:
        write, read = disk_bandwidth(args.disk_dir)
        print(f"disk tier: {args.disk_dir}, O_DIRECT write {write:.1f} GB/s, read {read:.1f} GB/s")
    header = (f"{'tool':<19}{'budget':>10} {'cyc':>4} {'paused':>7} {'pause GB/s':>11} {'p/link':>7} "
              f"{'resume GB/s':>12} {'host held (PSS)':>16} {'ledger peak':>12} {'on disk':>10} {'refused':>8} "
              f"{'ok':>4}")
    print(header)
    print("-" * len(header))
    setups: list[tuple[str, int | None, str | None]] = [("ours", need + need // 4, None), ("ours", need * 5 // 8, None)]
    if args.share:
        setups.append(("ours, shared", need + need // 4, None))
    if args.disk_dir:
        setups.append(("ours + disk tier", need * 5 // 8, args.disk_dir))
    if args.tms_path:
        setups.append(("torch_memory_saver", None, None))
    for tool, budget, disk_dir in setups:
        ours = tool.startswith("ours")
        result = run_node("ours" if ours else "tms", args.processes, args.gib, args.cycles, args.rollout, budget,
                          "" if ours else args.tms_path, disk_dir, share=tool == "ours, shared")
        for i, c in enumerate(result["cycles"]):
            peak = result["ledger_peak"]
            print(f"{tool:<19}{(f'{budget / GiB:.1f} GiB' if budget else 'none'):>10} {i + 1:>4} "
                  f"{c['paused']:>4}/{args.processes:<2} "
                  f"{c['pause_gbs']:>11.1f} {c['pause_gbs'] / link:>6.0%} {c['resume_gbs']:>12.1f} "
                  f"{c['held'] / GiB:>12.2f} GiB {(f'{peak / GiB:.2f} GiB' if peak is not None else '-'):>12} "
                  f"{c['spilled'] / GiB:>6.2f} GiB {c['refused']:>8} {'yes' if c['ok'] else 'NO':>4}")
    print("paused: processes whose pause went through (a refused pause is retried every 50 ms for 3 s, then that "
          "engine stays resident); pause GB/s: their bytes over the time from the first pause's start to the last "
          "one's end; host held: the sum of the processes' PSS growth while paused; ledger peak: the most the "
          "node's ledger showed held at once; on disk: backups the disk tier wrote; ok: every process's weights "
          "bit-identical after the resume")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--tms-path", default=None, help="a folder holding torch_memory_saver (side by side)")
    parser.add_argument("--disk-dir", default=None, help="a directory on a real disk for the budget's disk tier")
    parser.add_argument("--share", action="store_true", help="also with identical backups stored once per node")
    parser.add_argument("--sequence-only", action="store_true", help="only table 2")
    parser.add_argument("--distinct", action="store_true", help="each process's weights its own (not identical)")
    parser.add_argument("--rollout", type=float, default=0.5,
                        help="seconds each engine works between a resume and its next pause, and before its first")
    args = parser.parse_args()
    if args.distinct:
        os.environ["BENCH_DISTINCT"] = "1"  # the workers' environment
    if not torch.cuda.is_available():
        sys.exit("bench_node_host_memory.py needs a CUDA GPU")
    link = pinned_bandwidth(1 << 30)
    need = int(args.processes * args.gib * GiB)
    print(f"device: {torch.cuda.get_device_name()}; pinned D2H {link:.1f} GB/s; {args.processes} processes x "
          f"{args.gib:g} GiB of {'distinct' if args.distinct else 'identical'} weights, backed up "
          f"({need / GiB:.1f} GiB in all)")
    if not args.sequence_only:
        node_table(args, link, need)
    print()
    print(f"one process, tags a, b, c of {args.gib:g} GiB each, paused and resumed in turn, {args.rollout:g} s of "
          f"rollout after each resume (GB/s of each pause; link {link:.1f} GB/s); then 4096 x 2 MiB allocated "
          f"without backup in that process and in a fresh one")
    tools = [("ours", "")] + ([("torch_memory_saver", args.tms_path)] if args.tms_path else [])
    for tool, path in tools:
        result = run_sequence("ours" if tool == "ours" else "tms", args.gib, args.cycles, args.rollout, path)
        print(f"  {tool}:")
        for i, speeds in enumerate(result["rounds"]):
            print(f"    round {i + 1}: " + ", ".join(f"{tag} {s:.1f} ({s / link:.0%})"
                                                   for tag, s in zip("abc", speeds, strict=True)))
        released = result.get("after_release_ms")
        print(f"    4096 x 2 MiB without backup: {result['after_ms']:.1f} ms after the rounds"
              + (f" (4096 more: {released:.1f} ms once the host cache was released)" if released is not None else "")
              + f", {result['fresh_ms']:.1f} ms in a fresh process")

if __name__ == "__main__":
    main()
