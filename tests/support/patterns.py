"""The content tests write and check again: deterministic bytes that depend on their position
and a seed, regenerated to compare (in this process, or in a child that imports this module).

Byte i is ((i * step + seed * seed_step) >> shift) % modulus, for i counted within a period
that repeats (a 4 KiB page by default: cheap to make for hundreds of MiB) or, with period
None, across the whole size. With `device`, a uint8 tensor made there (on a GPU, in chunks, so
that the int64 temporaries stay small) instead of bytes.
"""

from __future__ import annotations

from typing import Any

# Every byte of a buffer different from its neighbours and no page like another (a page
# moved, swapped or zeroed shows): the GPU tests' content, `pattern(n, seed, device=..., **SCATTERED)`.
SCATTERED: dict[str, Any] = {"step": 2654435761, "seed_step": 40503, "shift": 7, "modulus": 256, "period": None}


def pattern(size: int, seed: int = 7, *, step: int = 7, seed_step: int = 1, shift: int = 0, modulus: int = 251,
            period: int | None = 4096, device: str | None = None, chunk: int = 64 << 20) -> Any:
    """`size` bytes of content for `seed` (a whole number of periods: size // period of them),
    as bytes, or as a uint8 tensor on `device`."""
    length = size if period is None else period
    if device is None:
        one = bytes(((i * step + seed * seed_step) >> shift) % modulus for i in range(length))
        return one if period is None else one * (size // period)
    import torch

    out = torch.empty(length, dtype=torch.uint8, device=device)
    for start in range(0, length, chunk):
        index = torch.arange(start, min(start + chunk, length), device=device, dtype=torch.int64)
        out[start:start + index.numel()] = (((index * step + seed * seed_step) >> shift) % modulus).to(torch.uint8)
    return out if period is None else out.repeat(size // period)
