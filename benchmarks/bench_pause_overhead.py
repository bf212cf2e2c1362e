"""What a pause()/resume() call costs around the memory work itself, by allocation count.

    python benchmarks/bench_pause_overhead.py [--counts 1,100,10000]

Runs on the host backend (no GPU needed), so it measures the library's own cost: the Python
layer, the crossing into the core and the core's table work. For each count N: N live
64 KiB allocations in tag "bulk"; then the median time of
- pause/resume of "bulk" itself (N allocations released and mapped again), and
- pause/resume of a one-allocation tag "one" while the N others stay live (what every call
  pays for the size of the table).
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch_mem_saver_lite import _lib
from torch_mem_saver_lite.testing import HostSaver

GRANULE = 64 << 10


def malloc(size: int) -> int:
    ptr = _lib.lib().tmsl_torch_malloc(size, 0, None)
    if not ptr:
        raise _lib.last_error()
    return ptr


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cycle_ms(saver: HostSaver, tag: str) -> tuple[float, float]:
    """One pause and one resume of `tag`, each timed on its own (ms)."""
    return median_ms(lambda: saver.pause(tag), 1), median_ms(lambda: saver.resume(tag), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,100,10000")
    args = parser.parse_args()
    print(f"{'allocations':>11} {'pause bulk':>11} {'resume bulk':>12} {'pause one':>10} {'resume one':>11}"
          "  (ms, median)")
    for count in (int(c) for c in args.counts.split(",")):
        saver = HostSaver(granularity_bytes=GRANULE)
        with saver.region("bulk"):
            for _ in range(count):
                malloc(GRANULE)
        with saver.region("one"):
            malloc(GRANULE)
        repeats = max(5, min(200, 20000 // count))
        pause_bulk = resume_bulk = 0.0
        cycles = [cycle_ms(saver, "bulk") for _ in range(repeats)]
        pause_bulk = statistics.median(c[0] for c in cycles)
        resume_bulk = statistics.median(c[1] for c in cycles)
        cycles = [cycle_ms(saver, "one") for _ in range(max(20, repeats))]
        pause_one = statistics.median(c[0] for c in cycles)
        resume_one = statistics.median(c[1] for c in cycles)
        print(f"{count:>11} {pause_bulk:>11.3f} {resume_bulk:>12.3f} {pause_one:>10.3f} {resume_one:>11.3f}")
        saver.close()


if __name__ == "__main__":
    main()
