"""The saver's core over host memory, for tests and machines without a GPU.

``HostSaver`` runs the same native core as the CUDA saver on a host backend built on Linux
primitives (reserve: ``mmap(PROT_NONE)``; physical memory: ``memfd_create``; map:
``mmap(MAP_FIXED|MAP_SHARED)``; release: ``close``), with an optional capacity so that
out-of-memory paths can be exercised, and fault injection. Pause really returns pages and
resume really maps zeroed ones at the same address. It cannot serve torch tensors: its
allocations are made through the native hook directly (``tmsl_torch_malloc``, as torch's
pluggable allocator calls it) inside its regions.

    from torch_mem_saver_lite.testing import HostSaver
    host = HostSaver(capacity_bytes=64 << 20)
"""

from __future__ import annotations

from . import hook_modes
from .memory_saver import MemorySaver
from .settings import check_bytes


class HostSaver(MemorySaver):
    """A MemorySaver over host memory; ``close()`` it when done."""

    def __init__(self, capacity_bytes: int = 0, granularity_bytes: int = 2 << 20):
        """
        Args:
            capacity_bytes: physical bytes it may hold at once (0 = no limit).
            granularity_bytes: allocation rounding, a multiple of the page size.
        """
        self._host = hook_modes.HostPlatform(check_bytes(capacity_bytes, "capacity_bytes"),
                                             check_bytes(granularity_bytes, "granularity_bytes"))
        self._platform = self._host
        super().__init__()

    def inject_fault(self, operation: str, after_calls: int = 1, times: int = 1) -> None:
        """Make the ``after_calls``-th next call of the backend's ``operation`` (``"map"``,
        ``"unmap"``, ``"copy_to_host_async"``, ...), and the ``times - 1`` calls after it,
        fail as a driver error would."""
        self._core().inject_fault(operation, after_calls, times)

    def set_patience_for_replicas(self, seconds: float) -> None:
        """How long a pause whose content changed waits for the other holders of its chunks in
        the node's store to pause too, so that they share one rewrite of each chunk in place
        (default 0.1 s): a test sets it long, so that no timing decides what it checks."""
        self._core().set_patience_for_replicas(seconds)

    def close(self) -> None:
        """Free everything the saver holds; it cannot be used afterwards."""
        with self._lock:
            native, self._native = self._native, None  # its end removes its disk backup files
            self._host.close(native)
