"""Routing a region's allocations into its torch MemPool, in both hook modes.

One ``torch.cuda.MemPool`` per (tag, device). In "torch" mode the pool sits on a
``CUDAPluggableAllocator`` whose malloc/free are the library's ``tmsl_torch_malloc`` /
``tmsl_torch_free``. In "preload" mode the pool uses torch's ordinary allocator, whose
``cudaMalloc`` the preloaded library answers for threads inside a region. Either way
PyTorch's caching allocator keeps reusing blocks, but only within the tag's own pool, so
memory of one tag never serves another.

torch routes a thread to the *first* pool it was told about, so nesting is done here: an
inner region suspends the outer pool's routing and restores it on exit; ``suspended()``
(used by ``saver.disable()`` and graph capture) routes to no pool at all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_thread = threading.local()


def _stack() -> list:
    return _thread.__dict__.setdefault("routes", [])  # entries: (device, pool) or None


def _begin(route) -> None:
    if route is not None:
        device, pool = route
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool.id)


def _end(route) -> None:
    if route is not None:
        device, pool = route
        torch._C._cuda_endAllocateToPool(device, pool.id)


def _release(route) -> None:
    # Each begin takes a reference on the pool: give it back so the counts stay balanced.
    if route is not None:
        device, pool = route
        torch._C._cuda_releasePool(device, pool.id)


@contextlib.contextmanager
def _pushed(route) -> Iterator[None]:
    stack = _stack()
    outer = stack[-1] if stack else None
    _end(outer)
    _begin(route)
    stack.append(route)
    try:
        yield
    finally:
        stack.pop()
        _end(route)
        _release(route)
        _begin(outer)
        _release(outer)


class TorchPools:
    def __init__(self, library_path: str | None):
        """``library_path``: the library's pluggable allocator; None: torch's own (preload)."""
        self._library_path = library_path
        self._allocator = None
        self._pools: dict[tuple[str, int], torch.cuda.MemPool] = {}
        self._lock = threading.Lock()

    def pool(self, tag: str, device: int) -> torch.cuda.MemPool:
        """The pool for ``tag`` on ``device``, created on first use and kept for the process."""
        with self._lock:
            key = (tag, device)
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

    def drop(self, tag: str) -> None:
        """Forget ``tag``'s pools; torch frees their cached segments at its next empty_cache()."""
        with self._lock:
            for key in [k for k in self._pools if k[0] == tag]:
                del self._pools[key]

    def route(self, tag: str) -> contextlib.AbstractContextManager[None]:
        """Send this thread's allocations on the current device to ``tag``'s pool."""
        device = torch.cuda.current_device()
        return _pushed((device, self.pool(tag, device)))

    @staticmethod
    def suspended() -> contextlib.AbstractContextManager[None]:
        """Send this thread's allocations to torch's default pool for the block."""
        return _pushed(None)
