"""How a saver's allocations reach the core, as small objects that answer the facade's questions.

A hook mode says which allocator torch's pools use, which pool a graph capture uses, what
must hold before a region opens and whether it may be chosen now. A platform says what the
memory is and where its core comes from: CUDA memory that regions route torch's allocations
for (the process-wide core), or the host memory of the testing saver (a core of its own per
saver, allocated through the native hook directly).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch

from . import _lib, breakdown, graph_capture
from .errors import MemorySaverError
from .preload import check_preload_ready, cudamalloc_bypassed
from .regions import disable_pool


# ----- hook modes ----------------------------------------------------------------------------
class HookMode:
    name = ""

    def allocator_library(self) -> str | None:
        """The library torch's pluggable allocator loads for the saver's pools (None:
        torch's own allocator, whose cudaMalloc the preloaded library answers)."""
        raise NotImplementedError

    def capture_pool(self, given: Any, tag_pool: Any) -> Any:
        """The pool a ``cuda_graph`` capture uses."""
        raise NotImplementedError

    def check_ready(self) -> None:
        """Before a region: what the mode needs from the process (raises naming it)."""

    def refusal(self) -> str | None:
        """Why this mode cannot be chosen now, as a warning's text (None: it can); raises
        where choosing it would be an error."""
        return None


class _Torch(HookMode):
    name = "torch"

    def allocator_library(self) -> str | None:
        return _lib.library_path()

    def capture_pool(self, given: Any, tag_pool: Any) -> Any:
        # Always the tag's saver pool: the only one whose memory is ours.
        if given is not None and tuple(given) != tuple(tag_pool):
            warnings.warn("saver.cuda_graph: in torch hook mode the graph uses the tag's pauseable "
                          "pool; the pool argument is ignored", stacklevel=6)
        return tag_pool

    def refusal(self) -> str | None:
        if _lib.preload_active():
            return ("torch_mem_saver_lite: hook_mode stays 'preload': this process runs with the library "
                    "preloaded, which serves every allocation; the assignment of 'torch' is ignored")
        return None


class _Preload(HookMode):
    name = "preload"

    def allocator_library(self) -> str | None:
        return None

    def capture_pool(self, given: Any, tag_pool: Any) -> Any:
        # A given pool works: its cudaMalloc calls happen inside the region.
        return tag_pool if given is None else given

    def check_ready(self) -> None:
        if cudamalloc_bypassed():
            check_preload_ready()  # raises, naming the setting

    def refusal(self) -> str | None:
        check_preload_ready()
        return None


TORCH: HookMode = _Torch()
PRELOAD: HookMode = _Preload()
MODES = {mode.name: mode for mode in (TORCH, PRELOAD)}


def chosen(current: HookMode, name: str) -> HookMode:
    """The mode after assigning ``name`` (a known mode's): ``current`` where the new one
    cannot be chosen now (with a RuntimeWarning saying why)."""
    refusal = MODES[name].refusal()
    if refusal is not None:
        warnings.warn(refusal, RuntimeWarning, stacklevel=3)
        return current
    return MODES[name]


# ----- platforms -----------------------------------------------------------------------------
class Platform:
    """What a saver's memory is, and where its core comes from."""

    routes_torch = False  # regions route torch's CUDA allocations into the tag's pool
    on_device = False  # the memory is CUDA device memory

    def make_core(self, owner: object) -> _lib.NativeSaver:
        """The core for ``owner`` (a MemorySaver), made now."""
        raise NotImplementedError

    def find_core(self) -> _lib.NativeSaver | None:
        """The core if something made it already (creates nothing, starts no driver)."""
        return None

    def check_usable(self) -> None:
        """Before a pause or resume: raises where the saver can no longer be used."""

    def before_region(self, mode: HookMode) -> None:
        """Checks before a region opens (the caller refused a forked child already)."""
        mode.check_ready()

    def core_entered(self, native: _lib.NativeSaver) -> None:
        """A region is about to open on ``native``."""

    def route(self, pools: Any, tag: str, choice: int) -> Any:
        """The torch pool route of a region (None: torch is not routed)."""
        return None

    def disable_route(self) -> Any:
        """The torch route of a ``disable()`` block (None: torch is not routed)."""
        return None

    def capturing(self) -> bool:
        """Whether this thread's stream captures a CUDA graph now."""
        return False

    def default_region(self, native: _lib.NativeSaver, tag: str, caches: bool) -> None:
        """Give a new core the process region's backup settings from the environment."""

    def check_breakdown(self) -> None:
        raise MemorySaverError("memory_breakdown describes GPU memory; this saver manages host memory")


class _Cuda(Platform):
    routes_torch = on_device = True

    def make_core(self, owner: object) -> _lib.NativeSaver:
        return _lib.NativeSaver.process_wide()

    def find_core(self) -> _lib.NativeSaver | None:
        return _lib.NativeSaver.existing_process_wide()

    def before_region(self, mode: HookMode) -> None:
        if not torch.cuda.is_available():
            raise MemorySaverError(
                f"torch {torch.__version__} sees no CUDA GPU, so there is nothing to route into "
                "a region; run `python -m torch_mem_saver_lite` to see what is missing")
        mode.check_ready()
        graph_capture.note_graph_captures()
        graph_capture.keep_rng_graph_state_outside_regions(torch.cuda.current_device())

    def core_entered(self, native: _lib.NativeSaver) -> None:
        if not graph_capture.capturing():
            # The CUDA context's size, measured once per device (memory_breakdown).
            breakdown.record_baseline(torch.cuda.current_device(), native)

    def route(self, pools: Any, tag: str, choice: int) -> Any:
        return pools().route(tag, choice)

    def disable_route(self) -> Any:
        if not torch.cuda.is_available():
            return None
        device = torch.cuda.current_device()
        return device, disable_pool(device)

    def capturing(self) -> bool:
        return graph_capture.capturing()

    def default_region(self, native: _lib.NativeSaver, tag: str, caches: bool) -> None:
        # The preload-mode process region's backup backend.
        if not caches:
            native.set_option("caches_backups", "0", tag=tag)

    def check_breakdown(self) -> None:
        pass


def _destroy(native: _lib.NativeSaver) -> None:
    # Also at interpreter exit and in a forked child, where the core refuses: nothing to say then.
    with contextlib.suppress(MemorySaverError):
        native.destroy()


class HostPlatform(Platform):
    """The testing saver's: host memory, a core of its own per saver (closed with it)."""

    def __init__(self, capacity_bytes: int, granularity_bytes: int):
        self._options = (capacity_bytes, granularity_bytes)
        self.closed = False
        self._finalizer: weakref.finalize | None = None

    def check_usable(self) -> None:
        if self.closed:
            raise MemorySaverError("this HostSaver has been closed; make a new one")

    def make_core(self, owner: object) -> _lib.NativeSaver:
        self.check_usable()
        native = _lib.NativeSaver.host(*self._options)
        # Dropped without close(): its memory and its registry slot are still given back.
        self._finalizer = weakref.finalize(owner, _destroy, native)
        return native

    def close(self, native: _lib.NativeSaver | None) -> None:
        """No core from now on; ``native`` (the one made, if any) is destroyed."""
        self.closed = True
        if native is not None and self._finalizer is not None:
            self._finalizer.detach()
            native.destroy()


CUDA: Platform = _Cuda()
