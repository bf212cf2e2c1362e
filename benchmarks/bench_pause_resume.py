"""Pause/resume speed against the hardware limits measured in the same run.

    python benchmarks/bench_pause_resume.py [--gib 8] [--hook-modes torch,preload]
        [--workloads one_big,weights,many_small] [--json out.json] [--plot out.png]
        [--tms-path DIR] [--processes-without-backup 3] [--only-without-backup]
    python benchmarks/bench_pause_resume.py --replot out.json --plot out.png   # the chart again, no GPU

Workloads: one_big (one tensor, a KV cache), weights (~350 tensors of 2-64 MiB), many_small
(2 MiB tensors). Each runs without backup, with backup (backups freed after resume) and
with retained backups, six cycles each (nine without backup: milliseconds each): cycle 1 is
cold, the median of the others is reported as "2+". The variant without backup is measured in
three fresh processes per tool (--processes-without-backup), the tools taking turns, and its
rows are medians over all of them, printed with the spread of the processes' own medians.
Before a backed-up workload's first pause the process waits --rollout seconds (2), the
engine's first rollout; ours sets the host memory for the backups aside meanwhile when the
region closes (uncached, with no host cache, shows a first pause without it). Between a
pause and its resume the process idles --idle seconds (0.3), where
an RL loop runs its other engine: for about 0.1 s after gigabytes of device memory are
released, copies into freshly created memory run ~8 % slower (probe_copy_pipeline.py --only
release_gap), which a resume straight after its pause would measure instead. Limits measured
first: pinned host<->device copy bandwidth, the driver's create+map cost for 1 GiB in 2 MiB and
in 1 GiB pieces, and the speed of each stage of preparing fresh host memory (host_stages.py),
which bounds a first pause. Preload mode runs in a child process started with LD_PRELOAD. Each
row is checked against the targets.

torch_memory_saver runs too, side by side, when it is importable (installed, or in --tms-path,
a directory put on the children's PYTHONPATH: `pip install --no-deps --target DIR <wheel>`):
the same workloads and variants (it has no host cache: "uncached" is skipped), its preload
library from its own package. Every tool, hook mode and workload runs in a fresh child process,
the tools taking turns going first; each child notes how fast fresh host memory faulted in as
it started (on a virtual machine that varies over a run, and bounds the first cycles).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from support.workloads import WORKLOADS, tensor_sizes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MiB, GiB = 1 << 20, 1 << 30
FAULT_THREADS = max(1, min(15, len(os.sched_getaffinity(0)) - 1))  # as the saver's arena
# (name, enable_cpu_backup, retain_cpu_backup, host_cache_bytes: None = the default)
VARIANTS = (("none", False, False, None), ("backup", True, False, None), ("uncached", True, False, 0),
            ("retained", True, True, None))


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def copy_limits(nbytes: int) -> dict[str, float]:
    """Pinned D2H and H2D bandwidth in GB/s for one copy of the workloads' size, timed on the
    wall clock as the rows are (best of five); and H2D into device memory mapped just before,
    as a resume must copy (best of three)."""
    from cuda.bindings import driver as cu
    from support.driver_calls import map_fresh, ok

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("d2h", host, device), ("h2d", device, host)):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        result[name] = nbytes / best / 1e9
    del device
    torch.cuda.empty_cache()
    best = float("inf")
    size = -(-nbytes // (2 * MiB)) * 2 * MiB
    for _ in range(3):
        va, handle = map_fresh(size)
        start = time.perf_counter()
        ok(cu.cuMemcpyHtoD(va, host.data_ptr(), nbytes))
        best = min(best, time.perf_counter() - start)
        ok(cu.cuMemUnmap(va, size))
        ok(cu.cuMemRelease(handle))
        ok(cu.cuMemAddressFree(va, size))
    result["h2d_fresh"] = nbytes / best / 1e9
    del host
    # Give the pinned buffer back (torch caches it): the first cycles measured later fault in
    # fresh host memory, and should find as much free as a process that never measured.
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    return result


def create_map_limits() -> dict[str, float]:
    """ms per GiB to create+map+set access and to unmap+release, straight through cuda-python."""
    from cuda.bindings import driver as cu
    from support.driver_calls import device_props, ok

    prop, access = device_props()
    out = {}
    for label, piece in (("2MiB", 2 * MiB), ("1GiB", GiB)):
        count = GiB // piece
        va = ok(cu.cuMemAddressReserve(GiB, piece, 0, 0))
        start = time.perf_counter()
        handles = []
        for i in range(count):
            handle = ok(cu.cuMemCreate(piece, prop, 0))
            ok(cu.cuMemMap(int(va) + i * piece, piece, 0, handle, 0))
            ok(cu.cuMemSetAccess(int(va) + i * piece, piece, [access], 1))
            handles.append(handle)
        mapped = time.perf_counter()
        for i, handle in enumerate(handles):
            ok(cu.cuMemUnmap(int(va) + i * piece, piece))
            ok(cu.cuMemRelease(handle))
        released = time.perf_counter()
        ok(cu.cuMemAddressFree(va, GiB))
        out[f"map_ms_per_gib_{label}"] = (mapped - start) * 1e3
        out[f"unmap_ms_per_gib_{label}"] = (released - mapped) * 1e3
    return out


def checksum(tensor: torch.Tensor) -> int:
    """Sum of the bytes, 256 MiB at a time (a sum in int64 copies its input at 8x the size)."""
    return sum(int(piece.sum(dtype=torch.int64)) for piece in tensor.split(256 * MiB))


class Ours:
    """torch_mem_saver_lite through its own API."""

    name = "ours"
    variants = VARIANTS

    def __init__(self, hook_mode: str):
        from torch_mem_saver_lite import saver

        self.saver = saver
        saver.hook_mode = hook_mode
        self.hook_mode = hook_mode
        self.default_cache = saver.host_cache_bytes

    def configure(self, retain: bool, host_cache: int | None) -> None:
        self.saver.retain_cpu_backup = retain
        self.saver.host_cache_bytes = self.default_cache if host_cache is None else host_cache

    def region(self, tag: str, backup: bool):
        return self.saver.region(tag, enable_cpu_backup=backup)

    def pause(self, tag: str) -> None:
        self.saver.pause(tag)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)
        self.saver.wait_for_released_backups()

    def footprint(self, tag: str, tensors: list) -> tuple[int, int]:
        stats = self.saver.stats()[tag]
        return stats.reserved_bytes, stats.allocations

    def release(self, tag: str, tensors: list) -> None:
        tensors.clear()
        self.configure(False, None)
        self.saver.empty_cache(tag)  # give the device memory (and any retained backup) back
        assert self.saver.stats()[tag].allocations == 0, self.saver.stats()[tag]


class TorchMemorySaver:
    """torch_memory_saver through its public API (what frameworks call)."""

    name = "torch_memory_saver"
    variants = tuple(v for v in VARIANTS if v[0] != "uncached")  # it has no host cache

    def __init__(self, hook_mode: str):
        from torch_memory_saver import torch_memory_saver

        self.tms = torch_memory_saver
        self.kept: list[list] = []
        torch_memory_saver.hook_mode = hook_mode
        self.hook_mode = hook_mode

    def configure(self, retain: bool, host_cache: int | None) -> None:
        self.tms.retain_cpu_backup = retain

    def region(self, tag: str, backup: bool):
        return self.tms.region(tag=tag, enable_cpu_backup=backup)

    def pause(self, tag: str) -> None:
        self.tms.pause(tag)

    def resume(self, tag: str) -> None:
        self.tms.resume(tag)

    def footprint(self, tag: str, tensors: list) -> tuple[int, int]:
        # No per-tag figures there: the tensors' bytes, in whole 2 MiB pages.
        return sum(-(-t.nbytes // (2 * MiB)) * 2 * MiB for t in tensors), 0

    def release(self, tag: str, tensors: list) -> None:
        # Nothing safe to do: its torch mode complains, or ends the process, when pool memory
        # is freed outside a region. The tensors stay until the child exits.
        self.kept.append(list(tensors))
        tensors.clear()
        self.configure(False, None)


def run_workload(tool, workload: str, total: int, variant: str, backup: bool, retain: bool,
                 host_cache: int | None, cycles: int, idle: float, rollout: float) -> list[dict]:
    tag = f"bench-{workload}-{variant}-{tool.hook_mode}"
    tool.configure(retain, host_cache)

    def allocate(tag: str) -> tuple[list[torch.Tensor], float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with tool.region(tag, backup):
            tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in tensor_sizes(workload, total)]
        torch.cuda.synchronize()
        return tensors, (time.perf_counter() - start) * 1e3

    # Without backup the allocation is measured in three fresh regions (median): one takes
    # a millisecond or two, as noisy as the difference it is compared on. The two extra
    # regions stay allocated through the cycles, for both tools alike (torch_memory_saver
    # cannot release a region): a process that has released gigabytes already pays more for
    # its next release, so releasing them for one tool only would skew the comparison.
    extra_tags = [f"{tag}-alloc{i}" for i in range(2 if variant == "none" else 0)]
    extra = [allocate(t) for t in extra_tags]
    tensors, alloc_ms = allocate(tag)
    alloc_ms = statistics.median([alloc_ms, *(ms for _, ms in extra)])
    for i, tensor in enumerate(tensors):
        tensor.fill_(i % 251)
    del tensor  # only `tensors` may hold them: empty_cache below must free every segment
    sums = [checksum(t) for t in tensors] if backup else None
    nbytes, allocations = tool.footprint(tag, tensors)
    rss_start = rss_anon()
    if backup:
        time.sleep(rollout)  # the engine's first rollout, before its first pause
    rows = []
    for cycle in range(1, cycles + 1):
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        tool.pause(tag)
        t1 = time.perf_counter()
        released = torch.cuda.mem_get_info()[0] - free_before
        time.sleep(idle)  # the other engine's turn
        t2 = time.perf_counter()
        tool.resume(tag)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        rows.append(dict(tool=tool.name, workload=workload, hook_mode=tool.hook_mode, variant=variant,
                         cycle=cycle, allocations=allocations, bytes=nbytes, alloc_ms=alloc_ms,
                         pause_ms=(t1 - t0) * 1e3, resume_ms=(t3 - t2) * 1e3,
                         released_fraction=released / nbytes,
                         host_rss_delta_mib=(rss_anon() - rss_start) / MiB))
    content_ok = sums is None or sums == [checksum(t) for t in tensors]
    for row in rows:
        row["content_ok"] = content_ok
    for released_tag, released in (*zip(extra_tags, (kept for kept, _ in extra), strict=True), (tag, tensors)):
        tool.release(released_tag, released)
    return rows


def measure(tool_name: str, hook_mode: str, workloads: list[str], total: int, cycles: int,
            cycles_without_backup: int, idle: float, rollout: float, variants: list[str] | None) -> list[dict]:
    from support.host_stages import fault_in_speed

    tool = (Ours if tool_name == "ours" else TorchMemorySaver)(hook_mode)
    # How fast this machine faults in fresh host memory as the child starts: what its first
    # cycles (which fault in their backups' memory) are bound by, at that moment.
    host_gbps = fault_in_speed(GiB, FAULT_THREADS) if variants is None else None
    rows = []
    for workload in workloads:
        for variant, backup, retain, host_cache in tool.variants:
            if variants is not None and variant not in variants:
                continue
            # Without backup a cycle takes milliseconds, as noisy as the differences it is
            # compared on: more of them.
            n = cycles if backup else cycles_without_backup
            rows += run_workload(tool, workload, total, variant, backup, retain, host_cache, n, idle, rollout)
    for row in rows:
        row["host_fault_in_gbps"] = host_gbps
        row["process"] = os.getpid()
    return rows


def in_child(tool: str, mode: str, workloads: list[str], args, env: dict[str, str],
             variants: str | None = None) -> list[dict]:
    """measure() in a fresh process (preload mode needs LD_PRELOAD from the start), of every
    variant or the ones named."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        options = ["--gib", str(args.gib), "--workloads", ",".join(workloads), "--cycles", str(args.cycles),
                   "--cycles-without-backup", str(args.cycles_without_backup), "--idle", str(args.idle),
                   "--rollout", str(args.rollout), *(["--variants", variants] if variants else [])]
        child = subprocess.run([sys.executable, __file__, *options, "--child", f"{tool},{mode}",
                                "--child-output", out.name], env={**os.environ, **env})
        written = Path(out.name).read_text()
        if not written:  # torch_memory_saver may end its process non-zero at exit, after the rows
            raise RuntimeError(f"the {tool} {mode}-mode child wrote no rows (exit status {child.returncode})")
        return json.loads(written)


def tms_environment(tms_path: str | None) -> dict[str, str] | None:
    """The environment a torch_memory_saver child needs, or None when it is not installed."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (tms_path, os.environ.get("PYTHONPATH")) if p)}
    probe = subprocess.run([sys.executable, "-c", "import torch_memory_saver, sys; print(torch_memory_saver.__file__)"],
                           capture_output=True, text=True, env={**os.environ, **env})
    return env if probe.returncode == 0 else None


def tms_version(env: dict[str, str]) -> str | None:
    code = "import importlib.metadata as m; print(m.version('torch_memory_saver'))"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    return probe.stdout.strip() if probe.returncode == 0 else None


def run_facts(tms_env: dict[str, str] | None) -> dict:
    """What a chart of this run names in its title: the GPU and the versions measured (ours
    with its commit, where this is a checkout: the version alone does not change between them)."""
    import torch_mem_saver_lite

    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"],
                            capture_output=True, text=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "torch_mem_saver_lite": torch_mem_saver_lite.__version__,
            "commit": commit.stdout.strip() if commit.returncode == 0 else None,
            "torch_memory_saver": tms_version(tms_env) if tms_env is not None else None}


def tms_preload_library(env: dict[str, str]) -> str:
    code = ("from torch_memory_saver.utils import get_binary_path_from_package as p; "
            "print(p('torch_memory_saver_hook_mode_preload'))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.strip()


def summarize(rows: list[dict]) -> list[dict]:
    """One row for cycle 1 (cold) and one for the later cycles (warm), per tool, workload,
    hook mode and variant: medians over the cycles of every process that measured it (single
    cycles on a shared machine vary by a third; without backup, whole processes do too).
    `spread` holds the lowest and highest of the processes' own medians."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tool"], r["workload"], r["hook_mode"], r["variant"]), []).append(r)
    summary = []
    for group in groups.values():
        for label, cycles in (("1", [c for c in group if c["cycle"] == 1]),
                              ("2+", [c for c in group if c["cycle"] > 1])):
            if not cycles:
                continue
            row = dict(cycles[0], cycle=label, cycles=len(cycles))
            processes = sorted({c["process"] for c in cycles})
            row["processes"] = len(processes)
            row["spread"] = {}
            for key in ("alloc_ms", "pause_ms", "resume_ms"):
                if key not in cycles[0]:  # an earlier version's rows: no allocation time
                    continue
                row[key] = statistics.median(c[key] for c in cycles)
                own = [statistics.median(c[key] for c in cycles if c["process"] == p) for p in processes]
                row["spread"][key] = (min(own), max(own))
            row["released_fraction"] = min(c["released_fraction"] for c in cycles)
            row["host_rss_delta_mib"] = max(c["host_rss_delta_mib"] for c in cycles)
            summary.append(row)
    return summary


def add_ratios(rows: list[dict], limits: dict) -> None:
    for row in rows:
        gb = row["bytes"] / 1e9
        row["pause_gbps"] = gb / (row["pause_ms"] / 1e3)
        row["resume_gbps"] = gb / (row["resume_ms"] / 1e3)
        row["pause_ms_per_gib"] = row["pause_ms"] / (row["bytes"] / GiB)
        row["resume_ms_per_gib"] = row["resume_ms"] / (row["bytes"] / GiB)
        if row["variant"] != "none":
            row["pause_ratio"] = row["pause_gbps"] / limits["d2h"]
            row["resume_ratio"] = row["resume_gbps"] / limits["h2d"]
            if "h2d_fresh" in limits:  # measured since the fresh-memory limit was added
                row["resume_fresh_ratio"] = row["resume_gbps"] / limits["h2d_fresh"]


def check_targets(rows: list[dict], limits: dict) -> None:
    """row["target"]: whether our row meets its target, with torch_memory_saver's row
    of the same workload, mode, variant and cycle as the bar where one is measured."""
    theirs = {(r["workload"], r["hook_mode"], r["variant"], r["cycle"]): r
              for r in rows if r["tool"] == "torch_memory_saver"}
    for r in rows:
        if r["tool"] != "ours" or r["variant"] == "uncached":  # no target: an explicit opt-out of the cache
            r["target"] = "-"
            continue
        met = r["content_ok"] and r["released_fraction"] >= 0.99
        if r["variant"] in ("backup", "retained"):
            if r["cycle"] == "1":
                met &= r["pause_gbps"] >= 25 and r["resume_gbps"] >= 25
            else:
                met &= r["pause_ratio"] >= 0.9 and r["resume_ratio"] >= 0.9
        t = theirs.get((r["workload"], r["hook_mode"], r["variant"], r["cycle"]))
        if r["variant"] == "none" and t is not None:
            met &= all(r[k] <= t[k] for k in ("alloc_ms", "pause_ms", "resume_ms"))
        r["target"] = "ok" if met else "MISS"


def print_table(rows: list[dict], limits: dict) -> None:
    print(f"\nlimits: pinned D2H {limits['d2h']:.1f} GB/s, H2D {limits['h2d']:.1f} GB/s (into memory mapped just "
          f"before, as a resume copies: {limits['h2d_fresh']:.1f} GB/s); "
          f"driver create+map {limits['map_ms_per_gib_2MiB']:.1f} ms/GiB in 2 MiB pieces, "
          f"{limits['map_ms_per_gib_1GiB']:.2f} ms/GiB in one piece; unmap+release "
          f"{limits['unmap_ms_per_gib_2MiB']:.1f} / {limits['unmap_ms_per_gib_1GiB']:.2f} ms/GiB")
    first_cycle_bound = min(limits["fault_in_during_copy_gbps"], limits["page_lock_gbps"], limits["d2h"])
    print(f"first-cycle stages: fault in fresh host memory {limits['fault_in_gbps']:.1f} GB/s on "
          f"{limits['fault_threads']} threads, {limits['fault_in_during_copy_gbps']:.1f} GB/s while a copy runs; "
          f"page-lock {limits['page_lock_gbps']:.1f} GB/s on one thread: a first pause that prepares its own "
          f"host memory (uncached, cycle 1) cannot beat {first_cycle_bound:.1f} GB/s")
    header = (f"{'tool':18} {'workload':10} {'mode':7} {'backup':8} {'cyc':>3} {'allocs':>6} {'GiB':>5} "
              f"{'alloc ms':>8} {'pause ms':>9} {'resume ms':>9} {'pause':>12} {'resume':>12} {'p/limit':>7} "
              f"{'r/limit':>7} {'r/fresh':>7} {'released':>8} {'RSS+MiB':>8} {'ok':>3} {'target':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["variant"] == "none":
            pause, resume = f"{r['pause_ms_per_gib']:.2f}ms/GiB", f"{r['resume_ms_per_gib']:.2f}ms/GiB"
            pr = rr = rf = ""
        else:
            pause, resume = f"{r['pause_gbps']:.1f} GB/s", f"{r['resume_gbps']:.1f} GB/s"
            pr, rr, rf = f"{r['pause_ratio']:.0%}", f"{r['resume_ratio']:.0%}", f"{r['resume_fresh_ratio']:.0%}"
        print(f"{r['tool']:18} {r['workload']:10} {r['hook_mode']:7} {r['variant']:8} {r['cycle']:>3} "
              f"{r['allocations'] or '-':>6} {r['bytes'] / GiB:5.2f} {r['alloc_ms']:8.1f} {r['pause_ms']:9.1f} "
              f"{r['resume_ms']:9.1f} {pause:>12} {resume:>12} {pr:>7} {rr:>7} {rf:>7} {r['released_fraction']:8.1%} "
              f"{r['host_rss_delta_mib']:8.0f} {'yes' if r['content_ok'] else 'NO':>3} {r['target']:>6}")
    print("variants: backup = default settings (host cache of "
          f"{limits['host_cache_bytes'] / GiB:.1f} GiB); uncached = host_cache_bytes 0; retained = retain_cpu_backup")
    print("r/fresh = resume against a copy into memory mapped just before (what a resume must do, for every tool)")
    print("cycle 2+ = the median of the later cycles; ok = content bit-identical; target: backup and retained "
          "cycle 2+ >= 90% of the link, cycle 1 >= 25 GB/s; no backup: alloc, pause and resume no slower than "
          "torch_memory_saver's row; released >= 99% (RSS after a resume within the cache budget; uncached: ~0)")


def print_side_by_side(rows: list[dict]) -> None:
    """Ours against torch_memory_saver, row by row: milliseconds and their ratio (< 1: we are faster)."""
    theirs = {(r["workload"], r["hook_mode"], r["variant"], r["cycle"]): r
              for r in rows if r["tool"] == "torch_memory_saver"}
    if not theirs:
        return
    print("\nside by side (ms; ratio = ours / torch_memory_saver, below 1 is faster):")
    header = (f"{'workload':10} {'mode':7} {'backup':8} {'cyc':>3} | {'alloc':>14} {'ratio':>5} | "
              f"{'pause':>15} {'ratio':>5} | {'resume':>15} {'ratio':>5}")
    print(header)
    print("-" * len(header))
    for r in rows:
        t = theirs.get((r["workload"], r["hook_mode"], r["variant"], r["cycle"]))
        if r["tool"] != "ours" or t is None:
            continue
        cells = []
        for key in ("alloc_ms", "pause_ms", "resume_ms"):
            cells.append(f"{r[key]:7.1f}/{t[key]:<7.1f} {r[key] / t[key]:5.2f}")
        print(f"{r['workload']:10} {r['hook_mode']:7} {r['variant']:8} {r['cycle']:>3} | {cells[0]} | "
              f"{cells[1]} | {cells[2]}")
    print("\nwithout backup, each process's own median (ms, lowest-highest over the processes; ours | theirs):")
    for r in rows:
        t = theirs.get((r["workload"], r["hook_mode"], r["variant"], r["cycle"]))
        if r["tool"] != "ours" or t is None or r["variant"] != "none":
            continue
        cells = [f"{key[:-3]} {r['spread'][key][0]:.1f}-{r['spread'][key][1]:.1f} | "
                 f"{t['spread'][key][0]:.1f}-{t['spread'][key][1]:.1f}"
                 for key in ("alloc_ms", "pause_ms", "resume_ms")]
        print(f"{r['workload']:10} {r['hook_mode']:7} {r['cycle']:>3} ({r['processes']}/{t['processes']} processes): "
              + ";  ".join(cells))


TOOL_NAMES = {"ours": "torch_mem_saver_lite"}
VARIANT_NAMES = {"backup": "backup (default settings)", "uncached": "backup, no host cache",
                 "retained": "retained backup"}


def chart_title(rows: list[dict], run: dict | None) -> str:
    """The GPU, the bytes per workload and the versions measured; `run` is the JSON's "run"
    (None in a JSON written before the benchmark recorded it: the title says so)."""
    # Workloads of many tensors round their sizes: 8.0 GiB stands for 8 and 8.01.
    sizes = sorted({round(r["bytes"] / GiB, 1) for r in rows})
    size = f"{sizes[0]:.1f}" + (f"-{sizes[-1]:.1f}" if len(sizes) > 1 else "") + " GiB per workload"
    if run is None:
        return f"{size}; GPU and versions not recorded in this JSON (written by an earlier version)"
    ours = f"torch_mem_saver_lite {run['torch_mem_saver_lite']}" + (f" ({run['commit']})" if run["commit"] else "")
    versions = [f"torch {run['torch']}", ours]
    if any(r["tool"] == "torch_memory_saver" for r in rows):
        versions.append(f"torch_memory_saver {run['torch_memory_saver'] or '(version unknown)'}")
    return f"{run['device']}, {size}\n" + ", ".join(versions)


def plot(rows: list[dict], limits: dict, run: dict | None, path: str) -> Figure:
    """Cycle-2 GB/s with backup, grouped by workload and hook mode; the link limit as a line;
    the legend under the panels, clear of the bars; the title from chart_title. Returns the
    figure (closed; its artists stay readable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["variant"] != "none" and r["cycle"] == "2+"]
    groups = sorted({(r["workload"], r["hook_mode"]) for r in shown})
    series = sorted({(r["tool"], r["variant"]) for r in shown})
    fig, axes = plt.subplots(1, 2, figsize=(max(10, len(groups) * 2.2), 5), sharey=True)
    width = 0.8 / len(series)
    for ax, key, limit, title in ((axes[0], "pause_gbps", limits["d2h"], "pause (device to host)"),
                                  (axes[1], "resume_gbps", limits["h2d"], "resume (host to device)")):
        for k, (tool, variant) in enumerate(series):
            values = [next((r[key] for r in shown if (r["workload"], r["hook_mode"], r["tool"], r["variant"])
                            == (w, m, tool, variant)), 0) for w, m in groups]
            ax.bar([g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width,
                   label=f"{TOOL_NAMES.get(tool, tool)}: {VARIANT_NAMES.get(variant, variant)}")
        ax.axhline(limit, color="black", linestyle="--", label="link limit (pinned copy, measured in this run)")
        ax.annotate(f"{limit:.1f} GB/s", (1, limit), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                    textcoords="offset points", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(groups)), [f"{w}\n{m}" for w, m in groups])
        ax.set_title(f"{title}, cycles 2+ (median)", fontsize=10)
    axes[0].set_ylabel("GB/s")
    fig.suptitle(chart_title(rows, run), fontsize=10)
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    # Under the figure (savefig's tight box takes it in), where no bar can be.
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(3, len(labels)),
               fontsize=8, frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return fig


def replot(json_path: str, path: str) -> Figure:
    """The chart of a run drawn again from its JSON: the summary it wrote, or, from a run cut
    short or an earlier version's JSON (rows of ours alone), its rows summarized as a run does."""
    data = json.loads(Path(json_path).read_text())
    summary = data.get("summary")
    if summary is None:
        rows = [{"tool": "ours", "process": 0, **row} for row in data["rows"]]
        summary = summarize(rows)
        add_ratios(summary, data["limits"])
    return plot(summary, data["limits"], data.get("run"), path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bytes per workload, in GiB")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--hook-modes", default="torch,preload")
    parser.add_argument("--cycles", type=int, default=6, help="cycles per variant (the first is cold)")
    parser.add_argument("--cycles-without-backup", type=int, default=9,
                        help="cycles of the variant without backup (milliseconds each, so more of them)")
    parser.add_argument("--idle", type=float, default=0.3,
                        help="seconds between a pause and its resume, where the other engine would run")
    parser.add_argument("--rollout", type=float, default=2.0,
                        help="seconds between a backed-up workload's allocation and its first pause, where "
                             "the engine would run its first rollout")
    parser.add_argument("--json", help="write all rows and limits here")
    parser.add_argument("--plot", help="write a PNG bar chart here")
    parser.add_argument("--replot", metavar="JSON", help="measure nothing: draw the chart of the run that wrote "
                        "this --json file again, into --plot (needs no GPU)")
    parser.add_argument("--tms-path", help="a directory holding torch_memory_saver, for its children")
    parser.add_argument("--processes-without-backup", type=int, default=3,
                        help="fresh processes per tool that measure the variant without backup (its "
                             "milliseconds vary from process to process by more than between the tools)")
    parser.add_argument("--only-without-backup", action="store_true",
                        help="measure only the variant without backup (allocation, pause and resume "
                             "against torch_memory_saver), in --processes-without-backup processes each")
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replot:
        if not args.plot:
            parser.error("--replot draws a chart: say where with --plot out.png")
        replot(args.replot, args.plot)
        print(f"wrote {args.plot}")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU available: this benchmark needs one", file=sys.stderr)
        return 1
    total = int(args.gib * GiB)
    workloads = args.workloads.split(",")
    if args.child:  # a child process: measure one tool in one mode and hand the rows back
        tool, mode = args.child.split(",")
        variants = args.variants.split(",") if args.variants else None
        rows = measure(tool, mode, workloads, total, args.cycles, args.cycles_without_backup, args.idle,
                       args.rollout, variants)
        Path(args.child_output).write_text(json.dumps(rows))
        return 0

    from support.host_stages import stage_speeds

    from torch_mem_saver_lite import _lib, saver

    limits = {**copy_limits(total), **create_map_limits(), **stage_speeds(min(total, 4 * GiB), FAULT_THREADS),
              "fault_threads": FAULT_THREADS, "host_cache_bytes": saver.host_cache_bytes}
    tms_env = tms_environment(args.tms_path)
    run = run_facts(tms_env)
    rows = []
    started = time.perf_counter()

    idle_free = torch.cuda.mem_get_info()[0]

    def child(tool: str, mode: str, workload: str, env: dict[str, str], variants: str | None = None) -> None:
        nonlocal rows
        # The last child's memory is given back after it exits, not at once: wait for it.
        deadline = time.perf_counter() + 30
        while torch.cuda.mem_get_info()[0] < idle_free - GiB and time.perf_counter() < deadline:
            time.sleep(0.2)
        rows += in_child(tool, mode, [workload], args, env, variants)
        host = rows[-1]["host_fault_in_gbps"]
        print(f"[{time.perf_counter() - started:5.0f} s] {tool} {mode} {workload} {variants or 'all variants'} "
              "measured" + (f" (fresh host memory faulted in at {host:.1f} GB/s as it started)" if host else ""),
              flush=True)
        if args.json:  # a run cut short still leaves what it measured
            Path(args.json).write_text(json.dumps({"limits": limits, "run": run, "rows": rows}, indent=1))

    for mode in args.hook_modes.split(","):
        # Each tool and workload in a fresh process of its own, one after the other: the same
        # driver state for both tools (a process that has mapped and released many GiB
        # already pays more for the next release), and the memory is given back at exit.
        # The tools take turns going first, workload by workload, so that neither always runs
        # right after the other's exit.
        for k, workload in enumerate(workloads):
            turns = [("ours", {"LD_PRELOAD": _lib.library_path()} if mode == "preload" else {})]
            if tms_env is not None:
                theirs = {"LD_PRELOAD": tms_preload_library(tms_env)} if mode == "preload" else {}
                turns.append(("tms", {**tms_env, **theirs}))
            for tool, env in turns[::-1] if k % 2 else turns:
                child(tool, mode, workload, env, "none" if args.only_without_backup else None)
            for repeat in range(1, args.processes_without_backup):
                for tool, env in turns[::-1] if (k + repeat) % 2 else turns:
                    child(tool, mode, workload, env, "none")
    summary = sorted(summarize(rows), key=lambda r: (r["tool"] != "ours", r["hook_mode"] != "torch",
                                                      workloads.index(r["workload"])))
    for table in (rows, summary):
        add_ratios(table, limits)
    check_targets(summary, limits)
    print(f"device: {run['device']}, torch {run['torch']}, torch_mem_saver_lite {run['torch_mem_saver_lite']} "
          f"({run['commit'] or 'commit unknown'})" + (f", torch_memory_saver {run['torch_memory_saver']}"
                                                       if tms_env is not None else
                                                       "; torch_memory_saver not installed: ours only"))
    print_table(summary, limits)
    print(f"between each pause and its resume the process idled {args.idle} s (the other engine's turn); "
          f"before a backed-up workload's first pause, {args.rollout} s (its first rollout; ours sets the host "
          "memory for its backups aside meanwhile, in the background, within the host cache's budget)")
    print_side_by_side(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"limits": limits, "run": run, "rows": rows, "summary": summary},
                                              indent=1))
    if args.plot:
        plot(summary, limits, run, args.plot)
    return 0 if all(r["content_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
