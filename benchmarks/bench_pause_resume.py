"""Pause/resume speed against the hardware limits measured in the same run.

    python benchmarks/bench_pause_resume.py [--gib 8] [--hook-modes torch,preload]
        [--workloads one_big,weights,many_small] [--json out.json] [--plot out.png]

Workloads: one_big (one tensor, a KV cache), weights (~350 tensors of 2-64 MiB), many_small
(2 MiB tensors). Each runs without backup, with backup (backups freed after resume) and
with retained backups, two cycles each: cycle 1 is cold, cycle 2 warm. Limits measured
first: pinned host<->device copy bandwidth, and the driver's create+map cost for 1 GiB in
2 MiB and in 1 GiB pieces. Preload mode runs in a child process started with LD_PRELOAD.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, tensor_sizes  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
# (name, enable_cpu_backup, retain_cpu_backup, host_cache_bytes: None = the default)
VARIANTS = (("none", False, False, None), ("backup", True, False, None), ("uncached", True, False, 0),
            ("retained", True, True, None))


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def copy_limits(nbytes: int = 2 * GiB) -> dict[str, float]:
    """Pinned D2H and H2D bandwidth in GB/s, best of five."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("d2h", host, device), ("h2d", device, host)):
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        result[name] = nbytes / best / 1e9
    return result


def create_map_limits() -> dict[str, float]:
    """ms per GiB to create+map+set access and to unmap+release, straight through cuda-python."""
    from cuda.bindings import driver as cu

    def ok(result):
        assert result[0] == cu.CUresult.CUDA_SUCCESS, result[0]
        return result[1] if len(result) == 2 else result[1:]

    device = torch.cuda.current_device()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    out = {}
    for label, piece in (("2MiB", 2 * MiB), ("1GiB", GiB)):
        count = GiB // piece
        va = ok(cu.cuMemAddressReserve(GiB, piece, 0, 0))
        start = time.perf_counter()
        handles = []
        for i in range(count):
            handle = ok(cu.cuMemCreate(piece, prop, 0))
            ok((cu.cuMemMap(int(va) + i * piece, piece, 0, handle, 0)[0], None))
            ok((cu.cuMemSetAccess(int(va) + i * piece, piece, [access], 1)[0], None))
            handles.append(handle)
        mapped = time.perf_counter()
        for i, handle in enumerate(handles):
            ok((cu.cuMemUnmap(int(va) + i * piece, piece)[0], None))
            ok((cu.cuMemRelease(handle)[0], None))
        released = time.perf_counter()
        ok((cu.cuMemAddressFree(va, GiB)[0], None))
        out[f"map_ms_per_gib_{label}"] = (mapped - start) * 1e3
        out[f"unmap_ms_per_gib_{label}"] = (released - mapped) * 1e3
    return out


def run_workload(saver, workload: str, total: int, variant: str, backup: bool, retain: bool,
                 host_cache: int | None, cycles: int) -> list[dict]:
    tag = f"bench-{workload}-{variant}-{saver.hook_mode}"
    default_cache = saver.host_cache_bytes
    saver.retain_cpu_backup = retain
    saver.host_cache_bytes = default_cache if host_cache is None else host_cache
    with saver.region(tag, enable_cpu_backup=backup):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in tensor_sizes(workload, total)]
    for i, tensor in enumerate(tensors):
        tensor.fill_(i % 251)
    del tensor  # only `tensors` may hold them: empty_cache below must free every segment
    sums = [int(t.sum(dtype=torch.int64)) for t in tensors] if backup else None
    nbytes = saver.stats()[tag].reserved_bytes
    rss_start = rss_anon()
    rows = []
    for cycle in range(1, cycles + 1):
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        saver.pause(tag)
        t1 = time.perf_counter()
        released = torch.cuda.mem_get_info()[0] - free_before
        t2 = time.perf_counter()
        saver.resume(tag)
        t3 = time.perf_counter()
        saver.wait_for_released_backups()
        rows.append(dict(workload=workload, hook_mode=saver.hook_mode, variant=variant, cycle=cycle,
                         allocations=saver.stats()[tag].allocations, bytes=nbytes,
                         pause_ms=(t1 - t0) * 1e3, resume_ms=(t3 - t2) * 1e3,
                         released_fraction=released / nbytes,
                         host_rss_delta_mib=(rss_anon() - rss_start) / MiB))
    content_ok = sums is None or sums == [int(t.sum(dtype=torch.int64)) for t in tensors]
    for row in rows:
        row["content_ok"] = content_ok
    saver.retain_cpu_backup = False
    saver.host_cache_bytes = default_cache
    del tensors
    saver.empty_cache(tag)  # give the device memory (and any retained backup) back
    assert saver.stats()[tag].allocations == 0, saver.stats()[tag]
    return rows


def measure(hook_mode: str, workloads: list[str], total: int, cycles: int) -> list[dict]:
    from torch_mem_saver_lite import saver

    saver.hook_mode = hook_mode
    rows = []
    for workload in workloads:
        for variant, backup, retain, host_cache in VARIANTS:
            rows += run_workload(saver, workload, total, variant, backup, retain, host_cache, cycles)
    return rows


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


def print_table(rows: list[dict], limits: dict) -> None:
    print(f"\nlimits: pinned D2H {limits['d2h']:.1f} GB/s, H2D {limits['h2d']:.1f} GB/s; "
          f"driver create+map {limits['map_ms_per_gib_2MiB']:.1f} ms/GiB in 2 MiB pieces, "
          f"{limits['map_ms_per_gib_1GiB']:.2f} ms/GiB in one piece; unmap+release "
          f"{limits['unmap_ms_per_gib_2MiB']:.1f} / {limits['unmap_ms_per_gib_1GiB']:.2f} ms/GiB")
    header = (f"{'workload':10} {'mode':7} {'backup':8} {'cyc':>3} {'allocs':>6} {'GiB':>5} {'pause ms':>9} "
              f"{'resume ms':>9} {'pause':>12} {'resume':>12} {'p/limit':>7} {'r/limit':>7} "
              f"{'released':>8} {'RSS+MiB':>8} {'ok':>3}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["variant"] == "none":
            pause, resume = f"{r['pause_ms_per_gib']:.2f}ms/GiB", f"{r['resume_ms_per_gib']:.2f}ms/GiB"
            pr = rr = ""
        else:
            pause, resume = f"{r['pause_gbps']:.1f} GB/s", f"{r['resume_gbps']:.1f} GB/s"
            pr, rr = f"{r['pause_ratio']:.0%}", f"{r['resume_ratio']:.0%}"
        print(f"{r['workload']:10} {r['hook_mode']:7} {r['variant']:8} {r['cycle']:>3} {r['allocations']:>6} "
              f"{r['bytes'] / GiB:5.2f} {r['pause_ms']:9.1f} {r['resume_ms']:9.1f} {pause:>12} {resume:>12} "
              f"{pr:>7} {rr:>7} {r['released_fraction']:8.1%} {r['host_rss_delta_mib']:8.0f} "
              f"{'yes' if r['content_ok'] else 'NO':>3}")
    print("variants: backup = default settings (host cache of "
          f"{limits['host_cache_bytes'] / GiB:.1f} GiB); uncached = host_cache_bytes 0; retained = retain_cpu_backup")
    print("targets: backup and retained cycle 2 >= 90% of the limit; cycle 1 >= 25 GB/s; no backup "
          "<= 1 ms/GiB (one_big), <= 4 ms/GiB (many_small); released 100%; RSS after a resume within "
          "the cache budget (uncached: back to ~0)")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["variant"] != "none"]
    labels = [f"{r['workload']}\n{r['hook_mode']}/{r['variant']}/c{r['cycle']}" for r in shown]
    fig, ax = plt.subplots(figsize=(max(8, len(shown) * 0.6), 5))
    x = range(len(shown))
    ax.bar([i - 0.2 for i in x], [r["pause_gbps"] for r in shown], width=0.4, label="pause")
    ax.bar([i + 0.2 for i in x], [r["resume_gbps"] for r in shown], width=0.4, label="resume")
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("pause/resume with CPU backup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bytes per workload, in GiB")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--hook-modes", default="torch,preload")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--json", help="write all rows and limits here")
    parser.add_argument("--plot", help="write a PNG bar chart here")
    parser.add_argument("--child-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU available: this benchmark needs one", file=sys.stderr)
        return 1
    total = int(args.gib * GiB)
    workloads = args.workloads.split(",")
    if args.child_output:  # a preload-mode child: measure and hand the rows back
        Path(args.child_output).write_text(json.dumps(measure("preload", workloads, total, args.cycles)))
        return 0

    from torch_mem_saver_lite import saver

    limits = {**copy_limits(), **create_map_limits(), "host_cache_bytes": saver.host_cache_bytes}
    rows = []
    for mode in args.hook_modes.split(","):
        if mode == "torch":
            rows += measure("torch", workloads, total, args.cycles)
        else:
            from torch_mem_saver_lite import _lib

            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                env = {**os.environ, "LD_PRELOAD": _lib.library_path()}
                subprocess.run([sys.executable, __file__, "--gib", str(args.gib), "--workloads",
                                args.workloads, "--cycles", str(args.cycles), "--child-output", out.name],
                               check=True, env=env)
                rows += json.loads(Path(out.name).read_text())
    add_ratios(rows, limits)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print_table(rows, limits)
    if args.json:
        Path(args.json).write_text(json.dumps({"limits": limits, "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r["content_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
