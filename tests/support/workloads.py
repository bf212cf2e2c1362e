"""The memory layouts the benchmark and the GPU tests pause: a KV cache, a model's weights,
many small blocks. Sizes scale with `total_bytes` so they also fit small GPUs."""

from __future__ import annotations

import random

MiB = 1 << 20


def tensor_sizes(workload: str, total_bytes: int) -> list[int]:
    """Byte sizes of the tensors of `workload`, adding up to about `total_bytes`."""
    if workload == "one_big":
        return [total_bytes]
    if workload == "many_small":
        return [2 * MiB] * max(1, total_bytes // (2 * MiB))
    if workload == "weights":
        # ~350 tensors of 2-64 MiB for 8 GiB, like a transformer's matrices and norms.
        rng = random.Random(0)
        sizes, left = [], total_bytes
        while left >= 2 * MiB:
            size = min(left, rng.choice([2, 4, 8, 16, 24, 32, 48, 64]) * MiB)
            sizes.append(size)
            left -= size
        return sizes
    raise ValueError(f"unknown workload {workload!r}: one_big, weights or many_small")


WORKLOADS = ("one_big", "weights", "many_small")
