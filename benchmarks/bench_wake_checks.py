"""What a verified wake costs (``verify_wake``): pause and resume of one backed-up tensor of
--gib GiB with the check on and off, in the same process, alternating, against the pinned
link's time for the same bytes measured in the same run.

    python benchmarks/bench_wake_checks.py [--gib 8] [--cycles 6]

With the check on, a pause fingerprints the tensor on the GPU beside its copy, and a resume
fingerprints the restored bytes one 256 MiB piece behind the copies; the bar is at most 3 % of
the resume, and both still at >= 95 % of the link in cycles 2+.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from support.timing import timed_ms

from torch_mem_saver_lite import saver

GiB = 1 << 30


def link_ms(device: torch.Tensor) -> tuple[float, float]:
    """The link each way for these bytes (a pause copies to the host, a resume back), median of 3."""
    host = torch.empty(device.numel(), dtype=torch.uint8, pin_memory=True)
    to_host = statistics.median(timed_ms(lambda: host.copy_(device, non_blocking=True)) for _ in range(3))
    back = statistics.median(timed_ms(lambda: device.copy_(host, non_blocking=True)) for _ in range(3))
    return to_host, back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=6, help="cycles per setting (the first is left out)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    nbytes = args.gib * GiB
    with saver.region("weights", enable_cpu_backup=True):
        weights = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    expected = weights[:: 1 << 20].clone()
    link, back = link_ms(weights)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for cycle in range(args.cycles):
        for verify in (True, False):  # alternating, so drift hits both alike
            saver.verify_wake = verify
            pause = timed_ms(lambda: saver.pause("weights"))
            resume = timed_ms(lambda: saver.resume("weights"))
            assert torch.equal(weights[:: 1 << 20], expected), "content changed"
            check = saver.stats()["weights"].last_wake_check
            assert check == ("passed" if verify else "unchecked"), check
            if cycle > 0:
                times[verify].append((pause, resume))
    saver.verify_wake = True
    print(f"{torch.cuda.get_device_name()}, {args.gib} GiB backed up, cycles 2..{args.cycles} per setting, "
          f"median; link (pinned copies of the same bytes) to the host {link:.1f} ms = {nbytes / link / 1e6:.1f} GB/s, "
          f"back {back:.1f} ms = {nbytes / back / 1e6:.1f} GB/s")
    print("| verify_wake | pause ms | pause, % of link | resume ms | resume, % of link (back) |")
    print("| --- | --- | --- | --- | --- |")
    medians = {}
    for verify in (False, True):
        pause = statistics.median(p for p, _ in times[verify])
        resume = statistics.median(r for _, r in times[verify])
        medians[verify] = (pause, resume)
        print(f"| {'on' if verify else 'off'} | {pause:.1f} | {100 * link / pause:.0f} % | {resume:.1f} | "
              f"{100 * back / resume:.0f} % |")
    (pause_off, resume_off), (pause_on, resume_on) = medians[False], medians[True]
    print(f"check's cost: pause +{pause_on - pause_off:.1f} ms ({100 * (pause_on - pause_off) / pause_off:.1f} %), "
          f"resume +{resume_on - resume_off:.1f} ms ({100 * (resume_on - resume_off) / resume_off:.1f} %; bar <= 3 %)")


if __name__ == "__main__":
    main()
