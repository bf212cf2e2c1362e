"""What making stray access harmless costs (``stray_access``): pause and resume of memory
without a backup with the scratch covering it ("warn", the default) and without ("off", the raw
behaviour), in the same process, alternating.

Beside them, the bare driver calls a pause and resume without a backup make for the same bytes
(unmap + release; create + map + access: what torch_memory_saver's own pause and resume do).

    python benchmarks/bench_stray_access.py [--gib 8] [--cycles 9]

Workloads: one allocation of --gib GiB (a KV cache), and 512 of 2 MiB (many small allocations
pay per allocation: a map and an access change each), made straight from the core. "+ write" resumes after a
stray kernel wrote into the paused memory: the check finds it and the scratch is filled again.
The target of stray access: a pause without backup at most torch_memory_saver's + 5 ms (8 GiB);
bench_pause_resume.py --only-without-backup runs torch_memory_saver itself side by side.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
from support.driver_calls import device_props, ok
from support.timing import timed_ms

from torch_mem_saver_lite import StrayAccessWarning, saver

MiB, GiB = 1 << 20, 1 << 30


def bare_ms(size: int, pieces: int) -> tuple[float, float]:
    """The bare driver calls of a pause and a resume without backup for `pieces` allocations of
    `size` bytes (median of 3): unmap + release each; create + map + access each."""
    from cuda.bindings import driver as cu

    prop, access = device_props()
    vas = [int(ok(cu.cuMemAddressReserve(size, 0, 0, 0))) for _ in range(pieces)]
    handles = [ok(cu.cuMemCreate(size, prop, 0)) for _ in range(pieces)]

    def resume() -> None:
        for k, va in enumerate(vas):
            handles[k] = ok(cu.cuMemCreate(size, prop, 0))
            ok(cu.cuMemMap(va, size, 0, handles[k], 0))
            ok(cu.cuMemSetAccess(va, size, [access], 1))

    def pause() -> None:
        for va, handle in zip(vas, handles, strict=True):
            ok(cu.cuMemUnmap(va, size))
            ok(cu.cuMemRelease(handle))

    for va, handle in zip(vas, handles, strict=True):
        ok(cu.cuMemMap(va, size, 0, handle, 0))
        ok(cu.cuMemSetAccess(va, size, [access], 1))
    times = []
    for _ in range(3):
        times.append((timed_ms(pause), timed_ms(resume)))
    pause()
    for va in vas:
        ok(cu.cuMemAddressFree(va, size))
    return statistics.median(p for p, _ in times), statistics.median(r for _, r in times)


def measure(tag: str, first: int, cycles: int) -> dict[str, tuple[float, float]]:
    from cuda.bindings import driver as cu

    times: dict[str, list[tuple[float, float]]] = {"off": [], "warn": [], "warn + write": []}
    for cycle in range(cycles):
        for setting in times:  # alternating, so drift hits each alike
            saver.stray_access = setting.split()[0]
            pause = timed_ms(lambda: saver.pause(tag))
            if setting.endswith("write"):
                ok(cu.cuMemsetD8(first, 1, 4096))  # a stray write, while paused
            with warnings.catch_warnings(record=True) as told:
                warnings.simplefilter("always", StrayAccessWarning)
                resume = timed_ms(lambda: saver.resume(tag))
            assert len(told) == (1 if setting.endswith("write") else 0), [str(w.message) for w in told]
            if cycle > 0:
                times[setting].append((pause, resume))
    saver.stray_access = "warn"
    return {s: (statistics.median(p for p, _ in t), statistics.median(r for _, r in t)) for s, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=9, help="cycles per setting (the first is left out)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    # Straight from the core, so that each is one allocation of exactly its size (torch's caching
    # allocator would gather the small ones into 20 MiB segments).
    torch.zeros(1, device="cuda")
    native, device = saver._core(), torch.cuda.current_device()
    for tag in ("kv", "small"):
        with saver.region(tag):
            pass
    workloads = {"kv": ([native.malloc(args.gib * GiB, device, "kv", False)], args.gib * GiB),
                 "small": ([native.malloc(2 * MiB, device, "small", False) for _ in range(512)], 2 * MiB)}
    print(f"{torch.cuda.get_device_name()}, cycles 2..{args.cycles} per setting, median ms; the scratch: 128 MiB")
    print("| workload | bare pause | bare resume | setting | pause | pause - bare | resume | resume - bare |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for tag, (addresses, size) in workloads.items():
        bare_pause, bare_resume = bare_ms(size, len(addresses))
        name = f"{args.gib} GiB, one tensor" if tag == "kv" else "512 x 2 MiB"
        for setting, (pause, resume) in measure(tag, addresses[0], args.cycles).items():
            print(f"| {name} | {bare_pause:.1f} | {bare_resume:.1f} | {setting} | {pause:.1f} | "
                  f"{pause - bare_pause:+.1f} | {resume:.1f} | {resume - bare_resume:+.1f} |")


if __name__ == "__main__":
    main()
