"""The user-facing MemorySaver: regions, pause/resume by tag, backups, stats."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch

from . import _lib
from .errors import MemorySaverError
from .hooks import TorchPools
from .preload import check_preload_ready, cudamalloc_bypassed
from .stats import TagStats

_HOOK_MODES = ("torch", "preload")
_MAX_TAG_LENGTH = 256

# Regions nest per thread, across savers: each entry is (native saver, tag, backup), or
# None inside saver.disable().
_thread = threading.local()


def _check_tag(tag: object) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, got {type(tag).__name__}")
    if not tag or len(tag) > _MAX_TAG_LENGTH or "\0" in tag:
        raise ValueError(f"tag must be 1 to {_MAX_TAG_LENGTH} characters without NUL, got {tag!r}")
    return tag


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _apply_thread_region(entry) -> None:
    if entry is None:
        _lib.disable_thread_region()
    else:
        native, tag, backup = entry
        native.enter_thread_region(tag, backup)


@contextlib.contextmanager
def _thread_region(entry) -> Iterator[None]:
    """Make ``entry`` this thread's region for the block (None: no region)."""
    stack = _thread.__dict__.setdefault("stack", [])
    _apply_thread_region(entry)
    stack.append(entry)
    try:
        yield
    finally:
        stack.pop()
        if stack:
            _apply_thread_region(stack[-1])
        else:
            _lib.leave_thread_region()


def _turn_off_nccl_graph_registration() -> None:
    """NCCL registers buffers captured in graphs; a pause replaces their physical memory and
    a replay would use stale registrations. Registration must be off before NCCL reads it."""
    if os.environ.get("NCCL_GRAPH_REGISTER") == "0":
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        raise MemorySaverError(
            "pauseable CUDA graphs need NCCL_GRAPH_REGISTER=0 (NCCL's graph buffer registrations go "
            "stale when a pause replaces physical memory, and a replay can hang), but NCCL is "
            "already initialized: set NCCL_GRAPH_REGISTER=0 in the environment before "
            "torch.distributed.init_process_group"
        )
    os.environ["NCCL_GRAPH_REGISTER"] = "0"


class MemorySaver:
    """Releases the device memory of tagged allocations and gives it back at the same addresses.

    Use the process-wide instance, ``torch_mem_saver_lite.saver``. ``MemorySaver(backend="host")``
    builds one over host memory (memfd + mmap) with the same semantics, for tests and for
    machines without a GPU; its allocations are made through the native hook directly.

    Reading a paused tensor is a user error: the GPU reports it as an illegal memory
    access, which ends the CUDA context. Resume before touching paused memory.
    """

    def __init__(
        self,
        backend: str = "cuda",
        *,
        host_capacity_bytes: int = 0,
        host_granularity_bytes: int = 2 << 20,
    ):
        """
        Args:
            backend: ``"cuda"`` (CUDA virtual memory) or ``"host"``.
            host_capacity_bytes: host backend only: physical bytes it may hold at once
                (0 = no limit), so out-of-memory paths can be exercised.
            host_granularity_bytes: host backend only: allocation rounding (a multiple of
                the page size).
        """
        if backend not in ("cuda", "host"):
            raise ValueError(f"backend must be 'cuda' or 'host', got {backend!r}")
        self._backend = backend
        self._host_options = (int(host_capacity_bytes), int(host_granularity_bytes))
        self._native: _lib.NativeSaver | None = None
        self._hook_mode = "torch"
        self._lock = threading.RLock()
        self._tags: dict[str, bool] = {}  # tag -> enable_cpu_backup, from first region entry
        self._pools: TorchPools | None = None
        self._memory_margin_bytes = 0
        self._retain_cpu_backup = False

    # ----- configuration -------------------------------------------------------------
    @property
    def hook_mode(self) -> str:
        """How allocations are intercepted.

        ``"torch"`` (default): a ``CUDAPluggableAllocator`` under one MemPool per tag.
        ``"preload"``: the library, preloaded with ``LD_PRELOAD``, answers ``cudaMalloc`` and
        ``cudaFree`` for the whole process. Set it before the first region.
        """
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        if mode not in _HOOK_MODES:
            raise ValueError(f"hook_mode must be one of {_HOOK_MODES}, got {mode!r}")
        if mode == self._hook_mode:
            return
        if self._pools is not None or self._tags:
            raise MemorySaverError(
                f"hook_mode is already {self._hook_mode!r} and regions have used it; "
                "set hook_mode before the first region"
            )
        if mode == "preload":
            check_preload_ready()
        self._hook_mode = mode

    @property
    def memory_margin_bytes(self) -> int:
        """Device memory (bytes) allocations and resumes must leave free; 0 = none."""
        return self._memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"memory_margin_bytes must be an int >= 0, got {nbytes!r}")
        self._memory_margin_bytes = nbytes
        if self._native is not None:
            self._native.set_memory_margin(nbytes)

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep host backups after resume and reuse them at the next pause (faster cycles,
        host memory held throughout). Default False: backups are freed after resume."""
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, retain: bool) -> None:
        self._retain_cpu_backup = _check_bool(retain, "retain_cpu_backup")
        if self._native is not None:
            self._native.set_retain_backups(retain)

    @property
    def enabled(self) -> bool:
        """Always True (torch_memory_saver compatibility)."""
        return True

    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"host"``."""
        return self._backend

    def _core(self) -> _lib.NativeSaver:
        with self._lock:
            if self._native is None:
                if self._backend == "cuda":
                    native = _lib.NativeSaver.process_wide()
                else:
                    native = _lib.NativeSaver.host(*self._host_options)
                native.set_memory_margin(self._memory_margin_bytes)
                native.set_retain_backups(self._retain_cpu_backup)
                self._native = native
            return self._native

    # ----- regions -------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False) -> Iterator[None]:
        """Allocations made on this thread inside the block become pauseable under ``tag``.

        Args:
            tag: names the memory for ``pause``/``resume``.
            enable_cpu_backup: keep the content across a pause (copied to host memory);
                without it a resumed allocation holds fresh memory of undefined content.
                A tag keeps the setting it was first used with.

        Regions nest; leaving one restores the enclosing one. Allocations on the current
        CUDA device are routed.
        """
        native = self._enter(tag, enable_cpu_backup)
        with _thread_region((native, tag, enable_cpu_backup)):
            if self._backend == "cuda":
                with self._torch_pools().route(tag):
                    yield
            else:
                yield

    def _enter(self, tag: str, enable_cpu_backup: bool) -> _lib.NativeSaver:
        """Checks shared by region() and cuda_graph(); returns the native saver."""
        _check_tag(tag)
        backup = _check_bool(enable_cpu_backup, "enable_cpu_backup")
        if self._backend == "cuda" and not torch.cuda.is_available():
            raise MemorySaverError(
                f"torch {torch.__version__} sees no CUDA GPU, so there is nothing to route into "
                "a region; run `python -m torch_mem_saver_lite` to see what is missing"
            )
        if self._hook_mode == "preload" and cudamalloc_bypassed():
            check_preload_ready()  # raises, naming the setting
        native = self._core()
        self._remember_tag(tag, backup)
        if native.stats().get(tag, {}).get("paused_bytes", 0):
            raise MemorySaverError(
                f"region {tag!r} is paused; resume it before allocating in it (a new tensor "
                "could be placed in its released memory)"
            )
        return native

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: torch.cuda.CUDAGraph,
        pool=None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        tag: str = "cuda_graph",
        enable_cpu_backup: bool = False,
    ) -> Iterator[None]:
        """Like ``torch.cuda.graph``, with the graph's memory pool pauseable under ``tag``.

        Graphs captured with the same tag share one pool (on the current device), as
        inference engines do when they capture one graph per batch size, largest first.
        In torch hook mode that pool is the tag's saver pool, and a ``pool`` argument other
        than it is ignored with a warning; in preload mode a given ``pool`` is used and its
        memory is pauseable because its ``cudaMalloc`` calls happen inside the region.

        Turns NCCL's graph buffer registration off for the process (``NCCL_GRAPH_REGISTER=0``),
        or raises if NCCL is already initialized without it.
        """
        native = self._enter(tag, enable_cpu_backup)
        _turn_off_nccl_graph_registration()
        pools = self._torch_pools()
        tag_pool = pools.pool(tag, torch.cuda.current_device()).id
        if self._hook_mode == "torch":
            if pool is not None and tuple(pool) != tuple(tag_pool):
                warnings.warn("saver.cuda_graph: in torch hook mode the graph uses the tag's pauseable "
                              "pool; the pool argument is ignored", stacklevel=3)
            pool = tag_pool
        elif pool is None:
            pool = tag_pool
        with _thread_region((native, tag, enable_cpu_backup)), pools.suspended():
            with torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                                  capture_error_mode=capture_error_mode):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations on this thread inside the block are ordinary, even within a region."""
        with _thread_region(None):
            if self._pools is not None:
                with self._pools.suspended():
                    yield
            else:
                yield

    def _remember_tag(self, tag: str, backup: bool) -> None:
        with self._lock:
            known = self._tags.setdefault(tag, backup)
        if known != backup:
            raise ValueError(
                f"tag {tag!r} was first used with enable_cpu_backup={known}; a tag keeps one "
                "backup setting, so use another tag for memory that needs the other"
            )

    def _torch_pools(self) -> TorchPools:
        with self._lock:
            if self._pools is None:
                torch_mode = self._hook_mode == "torch"
                self._pools = TorchPools(_lib.library_path() if torch_mode else None)
            return self._pools

    # ----- pause / resume --------------------------------------------------------------
    def _selection(self, tag: str | Sequence[str] | None) -> list[str] | None:
        if tag is None:
            return None
        if isinstance(tag, str):
            names = [tag]
        elif isinstance(tag, (list, tuple, set, frozenset)):
            names = list(tag)
        else:
            raise TypeError(f"tag must be a str, a list of str or None, got {type(tag).__name__}")
        with self._lock:
            known = set(self._tags)
        if self._native is not None:
            known |= set(self._native.stats())
        known = sorted(known)
        for name in names:
            _check_tag(name)
            if name not in known:
                raise ValueError(
                    f"unknown tag {name!r}: no region has used it; known tags: {known or 'none yet'}"
                )
        return names

    def pause(self, tag: str | Sequence[str] | None = None) -> None:
        """Release the device memory of the tag(s) (None: every tag), keeping addresses.

        Waits for the devices' queued work first; content of regions with
        ``enable_cpu_backup`` is copied to host memory. Pausing a paused tag does nothing.
        On failure every allocation is either still resident or paused with a full backup.
        """
        names = self._selection(tag)
        if self._native is None:
            return  # nothing was ever allocated
        self._refuse_during_capture("pause")
        self._native.pause(names)

    def resume(self, tag: str | Sequence[str] | None = None) -> None:
        """Give the tag(s) (None: every tag) device memory again, at the same addresses.

        Backed-up content is restored. Resuming an active tag does nothing. Raises
        ``OutOfMemoryError`` if the memory is not there; then everything this call covered
        stays paused with its backups and a later ``resume`` can succeed.
        """
        names = self._selection(tag)
        if self._native is None:
            return
        self._refuse_during_capture("resume")
        self._native.resume(names)

    def _refuse_during_capture(self, what: str) -> None:
        # Synchronizing or remapping while a graph captures would break the capture.
        if self._backend == "cuda" and torch.cuda.is_current_stream_capturing():
            raise MemorySaverError(f"cannot {what} while a CUDA graph is being captured on this "
                                   f"thread's stream; {what} before or after the capture")

    @contextlib.contextmanager
    def paused(self, tag: str | Sequence[str] | None = None) -> Iterator[None]:
        """Pause the tag(s) for the block and resume them on exit, also when it raises."""
        self.pause(tag)
        try:
            yield
        finally:
            self.resume(tag)

    # ----- inspection ------------------------------------------------------------------
    def stats(self) -> dict[str, TagStats]:
        """Per tag: allocations, reserved, resident, paused and host backup bytes."""
        native = self._native.stats() if self._native is not None else {}
        with self._lock:
            tags = set(self._tags) | set(native)
        return {tag: TagStats.from_native(native.get(tag, {})) for tag in sorted(tags)}

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        """The host copy of a paused tensor from a region with ``enable_cpu_backup=True``.

        Returns None while the tensor is resident (no host copy exists then). With
        ``zero_copy=True`` the result shares the backup's page-locked memory (a copy to
        the GPU from it runs at full link speed), which the next successful ``resume``
        frees: do not use it after that.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"get_cpu_backup needs a torch.Tensor, got {type(x).__name__}")
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup needs a contiguous tensor; pass the tensor it views")
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        host = self._core().find_backup(x.data_ptr(), nbytes)
        if host is None:
            return None
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(host), dtype=torch.uint8)
        cpu = raw.view(x.dtype).view(x.shape)
        return cpu if zero_copy else cpu.clone()

    def empty_cache(self, tag: str) -> None:
        """Free the memory ``tag``'s pool caches for tensors that no longer exist.

        PyTorch keeps freed blocks of a region cached in the tag's pool (so pausing the tag
        still covers them). Call this once none of the tag's tensors is alive to give that
        memory back for good; the next region of the tag starts a new pool.
        """
        _check_tag(tag)
        if self._pools is not None:
            self._pools.drop(tag)
        torch.cuda.empty_cache()

    def wait_for_released_backups(self) -> None:
        """Wait until host backups that resumes let go of are freed.

        A resume returns as soon as the content is back on the device and frees its host
        memory on a background thread; call this before measuring host memory.
        """
        if self._native is not None:
            self._native.wait_for_released_backups()

    # ----- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Free everything a host-backend saver holds. The process-wide saver lives until exit."""
        if self._backend == "cuda":
            raise MemorySaverError("the process-wide CUDA saver cannot be closed")
        with self._lock:
            if self._native is not None:
                self._native.destroy()
                self._native = None
            self._tags.clear()
