"""Routing a region's allocations into its torch MemPool, in both hook modes.

One ``torch.cuda.MemPool`` per (tag, device, backup choice). In "torch" mode the pool sits on a
``CUDAPluggableAllocator`` whose malloc/free are the library's ``tmsl_torch_malloc`` /
``tmsl_torch_free``. In "preload" mode the pool uses torch's ordinary allocator, whose
``cudaMalloc`` the preloaded library answers for threads inside a region. Either way
PyTorch's caching allocator keeps reusing blocks, but only within the pool, so memory of one
tag never serves another, and a block made under one backup choice never holds a tensor of a
region with another (each allocation keeps its region's choice: a tensor that must be backed
up must not land in a segment that is not).

torch routes a thread to the *first* pool it was told about, so nesting is done by the
region stack (memory_saver.py): an inner region ends the outer pool's routing and begins it
again on exit, with the functions below; an entry without a route (``saver.disable()``,
graph capture) routes to no pool at all.
"""

from __future__ import annotations

import threading

import torch

# (device, pool): where a thread's allocations on that device go.
Route = tuple[int, torch.cuda.MemPool]

# The same as torch takes it, (device, pool id), begun, ended and released by these three
# (each begin takes a reference on the pool; an end plus a release give it back).
begin_route = torch._C.__dict__.get("_cuda_beginAllocateCurrentThreadToPool")
end_route = torch._C.__dict__.get("_cuda_endAllocateToPool")
release_route = torch._C.__dict__.get("_cuda_releasePool")


class TorchPools:
    def __init__(self, library_path: str | None):
        """``library_path``: the library's pluggable allocator; None: torch's own (preload)."""
        self._library_path = library_path
        self._allocator = None
        self._pools: dict[tuple[str, int, int], torch.cuda.MemPool] = {}  # (tag, device, choice)
        self._lock = threading.Lock()

    def pool(self, tag: str, device: int, choice: int = -1) -> torch.cuda.MemPool:
        """The pool for ``tag`` on ``device`` for regions of that backup ``choice`` (the C
        ABI's encoding), created on first use and kept for the process."""
        with self._lock:
            key = (tag, device, choice)
            if key not in self._pools:
                if self._allocator is None and self._library_path is not None:
                    self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                        self._library_path, "tmsl_torch_malloc", "tmsl_torch_free"
                    )
                allocator = self._allocator.allocator() if self._allocator is not None else None
                # A MemPool belongs to the device current when it is made.
                with torch.cuda.device(device):
                    self._pools[key] = torch.cuda.MemPool(allocator)
            return self._pools[key]

    @property
    def table(self) -> dict[tuple[str, int, int], torch.cuda.MemPool]:
        """The pools by (tag, device, backup choice); the compat object's ``_mem_pools`` view."""
        return self._pools

    def drop(self, tag: str) -> None:
        """Forget ``tag``'s pools; torch frees their cached segments at its next empty_cache()."""
        with self._lock:
            for key in [k for k in self._pools if k[0] == tag]:
                del self._pools[key]

    def drop_idle(self, tags: set[str]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Forget the pools of ``tags`` that nothing but this table uses (no open region, no
        captured graph: torch's use count is 1), so that torch's next empty_cache() frees their
        cached free blocks; live tensors in them stay valid and the tag's next region starts a
        new pool. Returns (dropped, kept) (tag, device) keys."""
        dropped, kept = [], []
        with self._lock:
            for key in [k for k in self._pools if k[0] in tags]:
                use_count = getattr(self._pools[key], "use_count", None)
                if use_count is not None and use_count() == 1:
                    del self._pools[key]
                    dropped.append(key[:2])
                else:
                    kept.append(key[:2])
        return dropped, kept

    def route(self, tag: str, choice: int = -1) -> Route:
        """The route to the pool of ``tag`` and backup ``choice`` on the current device."""
        device = torch.cuda.current_device()
        return device, self.pool(tag, device, choice)
