"""torch hook mode: regions route allocations into torch MemPools backed by the library.

One ``torch.cuda.MemPool`` per (tag, device) sits on a ``CUDAPluggableAllocator`` whose
malloc/free are the library's ``tmsl_torch_malloc``/``tmsl_torch_free``. PyTorch's
caching allocator keeps working inside each pool; only the segments it asks for come
from the saver.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class TorchPools:
    def __init__(self, library_path: str):
        self._library_path = library_path
        self._allocator = None
        self._pools: dict[tuple[str, int], torch.cuda.MemPool] = {}
        self._lock = threading.Lock()

    def pool(self, tag: str, device: int) -> torch.cuda.MemPool:
        """The pool for ``tag`` on ``device``, created on first use and kept for the process."""
        with self._lock:
            key = (tag, device)
            if key not in self._pools:
                if self._allocator is None:
                    self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                        self._library_path, "tmsl_torch_malloc", "tmsl_torch_free"
                    )
                # A MemPool belongs to the device current when it is made.
                with torch.cuda.device(device):
                    self._pools[key] = torch.cuda.MemPool(self._allocator.allocator())
            return self._pools[key]

    @contextlib.contextmanager
    def route(self, tag: str) -> Iterator[None]:
        """Send this thread's allocations on the current device to ``tag``'s pool."""
        device = torch.cuda.current_device()
        with torch.cuda.use_mem_pool(self.pool(tag, device), device=device):
            yield
