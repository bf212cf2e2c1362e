"""What the content fingerprint costs on the GPU (csrc/platform/fingerprint.h): the time to
fingerprint --gib GiB of device memory where it lies, against the pinned link's time to copy
the same bytes to the host, measured in the same run.

    python benchmarks/bench_fingerprint.py [--gib 8] [--repeats 5]

A pause decides from the fingerprints which chunks need to cross the link at all; a replica
whose bytes the node already holds copies nothing, so its pause costs about the fingerprint.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from support.timing import timed_ms

from torch_mem_saver_lite import _lib, saver

GiB = 1 << 30


def fingerprint(tensor: torch.Tensor) -> list[int]:
    lanes = (ctypes.c_uint64 * 4)()
    _lib.check(_lib.lib().tmsl_fingerprint_memory(saver._core().handle, tensor.device.index or 0, tensor.data_ptr(),
                                                  tensor.numel(), 1, lanes))
    return list(lanes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not _lib.has_testing_abi():
        raise SystemExit("needs the testing ABI (an editable install: make install)")
    nbytes = args.gib * GiB
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    first = time.perf_counter()
    fingerprint(data[: 1 << 20])  # loads the kernel: once per process
    load_ms = (time.perf_counter() - first) * 1e3
    fingerprint_ms = [timed_ms(lambda: fingerprint(data)) for _ in range(args.repeats)]
    link_ms = [timed_ms(lambda: host.copy_(data, non_blocking=True)) for _ in range(args.repeats)]
    fp, link = statistics.median(fingerprint_ms), statistics.median(link_ms)
    print(f"{torch.cuda.get_device_name()}, {args.gib} GiB, median of {args.repeats}; "
          f"first use (loading the kernel) {load_ms:.1f} ms")
    print("| what | ms | GB/s | link time / this |")
    print("| --- | --- | --- | --- |")
    print(f"| pinned device-to-host copy (the link) | {link:.1f} | {nbytes / link / 1e6:.1f} | 1.00 |")
    print(f"| fingerprint on the GPU | {fp:.1f} | {nbytes / fp / 1e6:.1f} | {link / fp:.1f} |")


if __name__ == "__main__":
    main()
