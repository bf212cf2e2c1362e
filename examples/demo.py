"""A short tour: pause the memory behind weights and a KV cache, replay a CUDA graph after resume.

    python examples/demo.py [--gib 2]

Exits 1 with a clear message on a machine without a usable NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from torch_mem_saver_lite import saver


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the KV cache to pause")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU available: this demo needs an NVIDIA GPU and its driver "
              "(run `python -m torch_mem_saver_lite` to see what is missing)", file=sys.stderr)
        return 1

    with saver.region("weights", enable_cpu_backup=True):
        weight = torch.randn(4096, 4096, device="cuda")
    with saver.region("kv_cache"):
        kv_cache = torch.zeros(int(args.gib * (1 << 30)) // 4, device="cuda")
    static_in = torch.randn(8, 4096, device="cuda")

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_out = static_in @ weight  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static_out = static_in @ weight
    graph.replay()
    expected = static_out.clone()
    addresses = (weight.data_ptr(), kv_cache.data_ptr())

    free_before = torch.cuda.mem_get_info()[0]
    saver.pause()
    free_paused = torch.cuda.mem_get_info()[0]
    print(f"pause:  device free memory {gib(free_before)} -> {gib(free_paused)} "
          f"(+{gib(free_paused - free_before)})")
    saver.resume()
    print(f"resume: device free memory back to {gib(torch.cuda.mem_get_info()[0])}")

    static_out.zero_()
    graph.replay()
    same_addresses = addresses == (weight.data_ptr(), kv_cache.data_ptr())
    replay_ok = torch.equal(static_out, expected)
    print(f"addresses unchanged: {same_addresses}; graph replay after resume matches: {replay_ok}")
    for tag, stats in saver.stats().items():
        print(f"  {tag:9s} {stats}")
    return 0 if same_addresses and replay_ok else 1


if __name__ == "__main__":
    sys.exit(main())
