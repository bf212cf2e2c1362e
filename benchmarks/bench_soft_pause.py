"""What a soft pause costs (``soft_pause``): pause and resume of a backed-up tensor whose host
copy stays mapped at its address while paused, against the same tensor paused as before (its
address unmapped), in the same process, alternating, with the link measured in the same run
(a pinned copy of the same bytes each way). Also how fast a kernel reads the soft-paused
tensor (over the link), and cycle 1 apart: a soft copy is made by the driver the first time
(about 0.3 s per GiB on an H200) and kept for the next pauses where the host cache has room.

    python benchmarks/bench_soft_pause.py [--gib 8] [--cycles 6]

The target: pause and resume with backup in cycles 2+ at >= 95 % of the link with soft
pause on.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from support.timing import timed_ms

from torch_mem_saver_lite import saver

GiB = 1 << 30


def link_gbps(size: int) -> tuple[float, float]:
    """Pinned copies of `size` bytes, device to host and back (GB/s, best of 3)."""
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    d2h = min(timed_ms(lambda: host.copy_(device, non_blocking=True)) for _ in range(3))
    h2d = min(timed_ms(lambda: device.copy_(host, non_blocking=True)) for _ in range(3))
    return size / d2h / 1e6, size / h2d / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--cycles", type=int, default=6)
    args = parser.parse_args()
    size = int(args.gib * GiB)
    d2h, h2d = link_gbps(size)
    times: dict[str, list[tuple[float, float]]] = {"soft": [], "hard": []}
    read_gbps = []
    # One setting after the other: two copies of 8 GiB kept at once may not fit the host cache
    # (1/8 of the host's memory), and a copy made afresh every cycle measures the host instead.
    for name in ("hard", "soft"):
        tag = f"bench-{name}"
        with saver.region(tag, enable_cpu_backup=True, soft_pause=name == "soft"):
            tensor = torch.empty(size // 4, dtype=torch.float32, device="cuda").normal_()
        expected = tensor.double().sum().item()
        for cycle in range(args.cycles):
            pause = timed_ms(lambda tag=tag: saver.pause(tag))
            if name == "soft" and cycle > 0:
                read_ms = timed_ms(lambda tensor=tensor: tensor.sum())
                read_gbps.append(size / read_ms / 1e6)
            resume = timed_ms(lambda tag=tag: saver.resume(tag))
            times[name].append((pause, resume))
            assert tensor.double().sum().item() == expected, f"{name}: content changed"
        del tensor
        saver.empty_cache(tag)
        saver.release_host_cache()
        saver.wait_for_released_backups()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, {args.gib:g} GiB backed up, link: pinned D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s; "
          f"wake check {'on' if saver.verify_wake else 'off'}")
    print("| setting | cycle | pause ms | pause GB/s | % of link | resume ms | resume GB/s | % of link |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in ("hard", "soft"):
        rows = [("1", [times[name][0]]), ("2+ (median)", times[name][1:])]
        for label, cycles in rows:
            if not cycles:
                continue
            p = statistics.median(t[0] for t in cycles)
            r = statistics.median(t[1] for t in cycles)
            setting = "soft pause" if name == "soft" else "as before"
            print(f"| {setting} | {label} | {p:.1f} | {size / p / 1e6:.1f} | {size / p / 1e6 / d2h * 100:.0f} % | "
                  f"{r:.1f} | {size / r / 1e6:.1f} | {size / r / 1e6 / h2d * 100:.0f} % |")
    if read_gbps:
        print(f"a kernel reading the soft-paused tensor (sum): {statistics.median(read_gbps):.1f} GB/s; "
              "content bit-exact every cycle")


if __name__ == "__main__":
    main()
