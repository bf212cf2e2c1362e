"""How a saver's allocations reach the core, as objects that answer once.

A hook mode says which allocator torch's pools use, which pool a graph capture uses and
what must hold before a region opens. A platform says what the memory is: CUDA memory that
regions route torch's allocations for, or the host memory of the testing saver, allocated
through the native hook directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from . import _lib
from .preload import check_preload_ready, cudamalloc_bypassed


@dataclass(frozen=True)
class HookMode:
    name: str

    def allocator_library(self) -> str | None:
        """The library torch's pluggable allocator loads for the saver's pools (None:
        torch's own allocator, whose cudaMalloc the preloaded library answers)."""
        return _lib.library_path() if self.name == "torch" else None

    def capture_pool(self, given: Any, tag_pool: Any) -> Any:
        """The pool a ``cuda_graph`` capture uses: in torch mode always the tag's saver pool
        (the only one whose memory is ours), in preload mode the given one if any (its
        cudaMalloc calls happen inside the region)."""
        if self.name == "preload":
            return tag_pool if given is None else given
        if given is not None and tuple(given) != tuple(tag_pool):
            warnings.warn("saver.cuda_graph: in torch hook mode the graph uses the tag's pauseable "
                          "pool; the pool argument is ignored", stacklevel=4)
        return tag_pool

    def check_ready(self) -> None:
        """Before a region: preload mode needs torch to allocate through cudaMalloc."""
        if self.name == "preload" and cudamalloc_bypassed():
            check_preload_ready()  # raises, naming the setting


TORCH = HookMode("torch")
PRELOAD = HookMode("preload")
MODES = {mode.name: mode for mode in (TORCH, PRELOAD)}


@dataclass(frozen=True)
class Platform:
    routes_torch: bool  # regions route torch's CUDA allocations into the tag's pool
    on_device: bool  # the memory is CUDA device memory


CUDA = Platform(routes_torch=True, on_device=True)
HOST = Platform(routes_torch=False, on_device=False)  # the testing saver
