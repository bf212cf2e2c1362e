"""Host-backend soak with random faults and interrupts: no growth of RSS, file descriptors,
memory mappings or threads.

    python tests/soaks/soak_host.py [--cycles 10000] [--seed 0]

Each cycle picks one of: allocate in a region, free, pause, resume, a pause or resume with an
injected driver fault, a paused() block interrupted (KeyboardInterrupt) at a random line of
the library, a close-and-reopen of the saver. Backed-up content is checked after every
successful resume. Resource counts are taken after a warm-up and at the end.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support/: the helpers
from host_memory import HostMemory, rss_anon_bytes  # noqa: E402
from interrupts import interrupted_at  # noqa: E402
from torch_mem_saver_lite import MemorySaverError  # noqa: E402
from torch_mem_saver_lite.testing import HostSaver  # noqa: E402

KiB = 1 << 10
FAULTS = ["map", "unmap", "create_physical", "release_physical", "copy_to_host_async", "copy_from_host_async",
          "register_host", "wait_copies", "synchronize_device", "free_reservation", "reserve"]


def resources() -> dict[str, int]:
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    return dict(rss_mib=rss_anon_bytes() >> 20, fds=len(os.listdir("/proc/self/fd")), mappings=len(lines),
                saver_mappings=sum("memfd:tmsl" in line for line in lines),
                threads=len(os.listdir("/proc/self/task")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    mem = HostMemory()
    saver = HostSaver(granularity_bytes=64 * KiB)
    saver.host_cache_bytes = 2 << 20
    live: dict[int, tuple[str, int]] = {}  # ptr -> (tag, byte)
    counts: dict[str, int] = {}
    errors = 0
    start = None
    for cycle in range(args.cycles):
        if cycle == 200:
            start = resources()
        op = rng.choice(["alloc", "alloc", "free", "pause", "resume", "fault", "interrupt", "reopen"])
        counts[op] = counts.get(op, 0) + 1
        tag = rng.choice(["a", "b"])
        try:
            if op == "alloc" and len(live) < 32:
                with saver.region(tag, enable_cpu_backup=True):
                    ptr = mem.malloc(rng.choice([64, 128, 256]) * KiB)
                byte = rng.randrange(1, 256)
                mem.write(ptr, bytes([byte]) * 64)
                live[ptr] = (tag, byte)
            elif op == "free" and live:
                ptr = rng.choice(sorted(live))
                mem.free(ptr)
                del live[ptr]
            elif op == "pause":
                saver.pause(tag)
            elif op == "resume":
                saver.resume(tag)
            elif op == "fault":
                saver.inject_fault(rng.choice(FAULTS), rng.randrange(1, 4))
                rng.choice([saver.pause, saver.resume])(tag)
            elif op == "interrupt":
                interrupted_at(rng.randrange(1, 60), functools.partial(_paused_block, saver, tag))
            elif op == "reopen" and rng.random() < 0.02:
                saver.close()
                saver, live = HostSaver(granularity_bytes=64 * KiB), {}
                saver.host_cache_bytes = 2 << 20
        except MemorySaverError:
            errors += 1
        if op in ("resume", "fault", "interrupt"):
            try:
                saver.resume()
            except MemorySaverError:
                errors += 1
                continue
            bad = [p for p, (t, b) in live.items() if mem.read(p, 64) != bytes([b]) * 64]
            if bad:
                print(f"cycle {cycle}: content lost at {len(bad)} allocations")
                return 1
    for _ in range(4):  # a fault armed but not yet fired goes off here once: then it works
        try:
            saver.resume()
            break
        except MemorySaverError:
            errors += 1
    saver.close()
    HostSaver().close()  # a fresh saver: nothing left behind blocks it
    end = resources()
    # Python's own allocator may map a few arenas more over a long run; the saver's memory
    # mappings, file descriptors and threads must not grow at all.
    slack = {"rss_mib": 16, "mappings": 8}
    grew = {k: (start[k], end[k]) for k in start if end[k] - start[k] > slack.get(k, 0)}
    print(f"{args.cycles} cycles (seed {args.seed}): " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) +
          f"; {errors} injected failures surfaced as MemorySaverError")
    print("resources after warm-up -> end: " + ", ".join(f"{k} {start[k]} -> {end[k]}" for k in start))
    print("growth: " + (str(grew) if grew else "none"))
    return 1 if grew else 0


def _paused_block(saver, tag: str) -> None:
    with saver.paused(tag):
        pass


if __name__ == "__main__":
    sys.exit(main())
