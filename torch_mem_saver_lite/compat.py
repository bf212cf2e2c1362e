"""``torch_memory_saver``: torch_memory_saver's API over our saver, for frameworks that switch
without edits. Where the two tools differ on purpose, this object behaves like
torch_memory_saver (docs/migration.md's difference table lists every case):

- ``pause``/``resume`` of a tag no region has used does nothing (``saver`` raises, naming
  the known tags: a typo there should not pass silently);
- ``cuda_graph``'s default tag is ``"default"`` (``saver``'s is ``"cuda_graph"``), so
  ``pause("default")`` covers graph memory, as it does there.

Everything else is ``saver`` itself: the same regions, tags, settings and state. The members
torch_memory_saver lacks (``stats``, ``paused``, ...) are ``saver``'s, served here as they are
there. Code that reaches into torch_memory_saver's internals, as its own example programs do,
finds ``_ensure_initialized()`` and an ``_impl`` with the native library under
``_binary_wrapper.cdll`` (its ``tms_*`` entry points), the region pools under ``_mem_pools``
and ``_with_region_config``; until first use, ``_impl_ctor_kwargs``, the settings waiting for
it (frameworks patch the ``hook_mode`` setter to write there).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

import torch

from . import _lib
from .choices import CaptureErrorMode, CpuBackupBackend, HookModeName, StrayAccessMode
from .memory_saver import MemorySaver
from .regions import Region, pushed
from .settings import check_tag

P = ParamSpec("P")
R = TypeVar("R")
V = TypeVar("V")


class _Method(Generic[P, R]):
    """A method of ``saver`` served on the compat object as it is there: the wrapped saver's
    own (looked up by name, so an override or a patch of it is what runs), typed as
    ``MemorySaver``'s function is for type checkers, with its docstring."""

    def __init__(self, method: Callable[Concatenate[MemorySaver, P], R]) -> None:
        self._method = method
        self._name = method.__name__
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, compat: None, owner: type) -> Callable[Concatenate[MemorySaver, P], R]: ...
    @overload
    def __get__(self, compat: TorchMemorySaver, owner: type) -> Callable[P, R]: ...

    def __get__(self, compat: TorchMemorySaver | None, owner: type) -> Callable[..., R]:
        if compat is None:
            return self._method
        return cast(Callable[P, R], getattr(compat._saver, self._name))

    def __set__(self, compat: TorchMemorySaver, value: object) -> None:
        setattr(compat._saver, self._name, value)


class _Setting(Generic[V]):
    """A setting (property) of ``saver`` served on the compat object as it is there: read
    and set on the wrapped saver by name. Its type is named where it is declared
    (``_Setting[int]``), and tests/test_drop_in.py checks it against ``saver``'s."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self.__doc__ = getattr(MemorySaver, name).__doc__

    @overload
    def __get__(self, compat: None, owner: type) -> property: ...
    @overload
    def __get__(self, compat: TorchMemorySaver, owner: type) -> V: ...

    def __get__(self, compat: TorchMemorySaver | None, owner: type) -> V | property:
        if compat is None:
            return cast(property, getattr(MemorySaver, self._name))
        return cast(V, getattr(compat._saver, self._name))

    def __set__(self, compat: TorchMemorySaver, value: V) -> None:
        setattr(compat._saver, self._name, value)


class _NativeLibrary:
    """torch_memory_saver's ``cdll``: our native library, with torch_memory_saver's entry
    points (``tms_pause``, ``tms_get_current_tag``, ...) bound. torch_memory_saver's library
    links the CUDA runtime, so code also finds runtime functions through it (its examples
    call ``cudaHostGetFlags``); ours does not, so those come from the runtime torch loaded."""

    def __init__(self) -> None:
        self._ours = _lib.lib()

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._ours, name)
        except AttributeError:
            runtime = _loaded_cuda_runtime()
            if runtime is None:
                raise
            return getattr(runtime, name)


@functools.cache
def _loaded_cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded (torch's), if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcudart.so" in path:
                return ctypes.CDLL(path)
    return None


class _BinaryWrapper:
    """torch_memory_saver's ``_impl._binary_wrapper``."""

    def __init__(self) -> None:
        self.cdll = _NativeLibrary()


class _PoolTable(MutableMapping[tuple, torch.cuda.MemPool]):
    """torch_memory_saver's ``_impl._mem_pools``: the region pools under its keys, (tag,
    enable_cpu_backup, enable_disk_backup, cpu_backup_backend or "", device). Removing one
    forgets the pool, as there: torch frees its cached memory once nothing else holds it."""

    def __init__(self, saver: MemorySaver) -> None:
        self._saver = saver

    @staticmethod
    def _candidates(key: object) -> list[tuple[str, int, int]]:
        """Our keys for one of torch_memory_saver's (several: its "no backup" is our region
        default as well as an explicit False); none for a key of another shape."""
        if not (isinstance(key, tuple) and len(key) == 5):
            return []
        tag, backup, disk, backend, device = key
        if disk:
            return [(tag, device, _lib.CHOICE_DISK)]
        if backup:
            return [(tag, device, _lib.backup_choice(True, backend != "mmap"))]
        return [(tag, device, _lib.CHOICE_OFF), (tag, device, _lib.CHOICE_AUTO)]

    def _find(self, key: object) -> tuple[str, int, int]:
        pools = self._pools()
        for ours in self._candidates(key):
            if ours in pools:
                return ours
        raise KeyError(key)

    def _pools(self) -> dict[tuple[str, int, int], torch.cuda.MemPool]:
        return self._saver._torch_pools().table

    def __getitem__(self, key: tuple) -> torch.cuda.MemPool:
        return self._pools()[self._find(key)]

    def __setitem__(self, key: tuple, pool: torch.cuda.MemPool) -> None:
        candidates = self._candidates(key)
        if not candidates:
            raise KeyError(key)
        self._pools()[candidates[0]] = pool

    def __delitem__(self, key: tuple) -> None:
        del self._pools()[self._find(key)]

    def __iter__(self) -> Iterator[tuple]:
        for tag, device, choice in list(self._pools()):
            backup = choice in (_lib.CHOICE_ON, _lib.CHOICE_ON_UNCACHED)
            backend = ("mmap" if choice == _lib.CHOICE_ON_UNCACHED else "pinned") if backup else ""
            yield tag, backup, choice == _lib.CHOICE_DISK, backend, device

    def __len__(self) -> int:
        return len(self._pools())


class _Impl:
    """torch_memory_saver's ``_impl``, for code that reaches into it."""

    def __init__(self, saver: MemorySaver) -> None:
        self._saver = saver
        self._hook_mode = saver.hook_mode
        self._binary_wrapper = _BinaryWrapper()
        self._mem_pools = _PoolTable(saver)

    @contextlib.contextmanager
    def _with_region_config(self, tag: str, enable_cpu_backup: bool,
                            cpu_backup_backend: CpuBackupBackend | None = None,
                            enable_disk_backup: bool = False) -> Iterator[None]:
        """The thread's allocations go to ``tag`` with these settings, without a torch pool
        of their own (torch_memory_saver's native configuration alone)."""
        # No tag checks beyond the rule, as there; an allocation in a paused tag is still refused.
        choice = self._saver._region_choice(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        tag = check_tag(tag)
        native = self._saver._enter()
        if choice == _lib.CHOICE_DISK:
            self._saver._disk.require(native)  # the core writes the files at a pause
        with pushed(Region(native, tag, choice, checked=False)):
            yield


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` over a MemorySaver (the process-wide one is
    ``torch_mem_saver_lite.torch_memory_saver``)."""

    def __init__(self, saver: MemorySaver):
        self._saver = saver
        self._impl_instance: _Impl | None = None
        self._impl_lock = threading.Lock()
        # torch_memory_saver keeps the settings for its first use here and deletes the dict at
        # that use. AReaL patches the hook_mode setter to write only here, and only while it
        # exists; Dynamo reads hook_mode from it. So: the same dict, read at first use.
        self._impl_ctor_kwargs: dict[str, Any] = {}

    def _first_use(self) -> None:
        """What torch_memory_saver does on first use: the settings kept in
        ``_impl_ctor_kwargs`` (a patched ``hook_mode`` setter writes only there) go to the
        saver, and the dict is gone (kept where the saver refuses them, as there)."""
        with self._impl_lock:
            pending = self.__dict__.get("_impl_ctor_kwargs")
            if pending is None:
                return
            if "hook_mode" in pending:
                self._saver.hook_mode = pending["hook_mode"]
            del self._impl_ctor_kwargs

    # ----- torch_memory_saver's API ------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool | None = None, enable_disk_backup: bool = False,
               cpu_backup_backend: CpuBackupBackend | None = None) -> Iterator[None]:
        """Allocations on this thread inside the block are pauseable under ``tag``; each keeps
        this region's backup settings (``saver.region`` has the details)."""
        self._first_use()
        with self._saver.region(tag, enable_cpu_backup=enable_cpu_backup, enable_disk_backup=enable_disk_backup,
                                cpu_backup_backend=cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None,
                   stream: torch.cuda.Stream | None = None, capture_error_mode: CaptureErrorMode = "global",
                   tag: str = "default", enable_cpu_backup: bool | None = None,
                   cpu_backup_backend: CpuBackupBackend | None = None) -> Iterator[None]:
        """Like ``torch.cuda.graph``, with the graph's memory pauseable under ``tag``
        (default ``"default"``, as in torch_memory_saver); ``saver.cuda_graph`` has the details."""
        self._first_use()
        with self._saver.cuda_graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode,
                                    tag=tag, enable_cpu_backup=enable_cpu_backup,
                                    cpu_backup_backend=cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations on this thread inside the block are ordinary (``saver.disable``)."""
        self._first_use()
        with self._saver.disable():
            yield

    def _known(self, tag: object) -> list[str] | None:
        """The tags named that some region has used (None: every tag); a selection that is not
        None, a str or a list/tuple/set of str is a TypeError that changes nothing."""
        if tag is None:
            return None
        if isinstance(tag, str):
            names = [tag]
        elif isinstance(tag, (list, tuple, set, frozenset)) and all(isinstance(name, str) for name in tag):
            names = list(tag)
        else:
            raise TypeError(f"tag must be a str, a list of str or None, got {tag!r}")
        names = [check_tag(name) for name in names]
        known = set(self._saver.stats())
        return [name for name in names if name in known]

    def pause(self, tag: str | Sequence[str] | None = None) -> None:
        """Like ``saver.pause``; a tag no region has used is skipped, as torch_memory_saver does."""
        self._first_use()
        names = self._known(tag)
        if names != []:
            self._saver.pause(names)

    def resume(self, tag: str | Sequence[str] | None = None) -> None:
        """Like ``saver.resume``; a tag no region has used is skipped."""
        self._first_use()
        names = self._known(tag)
        if names != []:
            self._saver.resume(names)

    @property
    def enabled(self) -> bool:
        """Always True (torch_memory_saver's flag)."""
        return True

    @property
    def hook_mode(self) -> HookModeName:
        """``"torch"`` or ``"preload"`` (``saver.hook_mode``); set it before the first region."""
        return self._saver.hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: HookModeName) -> None:
        self._saver.hook_mode = mode
        with self._impl_lock:
            if "_impl_ctor_kwargs" in self.__dict__:  # before first use: where torch_memory_saver keeps it
                self._impl_ctor_kwargs["hook_mode"] = mode

    @property
    def memory_margin_bytes(self) -> int:
        """Device memory allocations and resumes leave free (``saver.memory_margin_bytes``)."""
        return self._saver.memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, nbytes: int) -> None:
        self._saver.memory_margin_bytes = nbytes

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep host backups after resume for the next pause (``saver.retain_cpu_backup``)."""
        return self._saver.retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, retain: bool) -> None:
        self._saver.retain_cpu_backup = retain

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        """The host copy of a backed-up tensor (``saver.get_cpu_backup``): while paused, or
        while resident when retention kept it."""
        self._first_use()
        return self._saver.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str | os.PathLike[str] | None) -> None:
        """The directory disk backups go to (``saver.set_disk_backup_dir``)."""
        self._first_use()
        self._saver.set_disk_backup_dir(path)

    # ----- torch_memory_saver's internals that code reaches --------------------------------
    def _ensure_initialized(self) -> None:
        """Start the saver (the native library, the CUDA driver): what torch_memory_saver does
        on first use, and its example programs call before reading the native state."""
        self._impl  # noqa: B018 - made on first access

    @property
    def _impl(self) -> _Impl:
        self._first_use()
        with self._impl_lock:
            if self._impl_instance is None:
                self._saver._core()
                self._impl_instance = _Impl(self._saver)
            return self._impl_instance

    # ----- saver's members, served as they are there ---------------------------------------
    stats = _Method(MemorySaver.stats)
    paused = _Method(MemorySaver.paused)
    register_hooks = _Method(MemorySaver.register_hooks)
    release_leftovers = _Method(MemorySaver.release_leftovers)
    restore_leftovers = _Method(MemorySaver.restore_leftovers)
    memory_breakdown = _Method(MemorySaver.memory_breakdown)
    empty_cache = _Method(MemorySaver.empty_cache)
    release_host_cache = _Method(MemorySaver.release_host_cache)
    wait_for_released_backups = _Method(MemorySaver.wait_for_released_backups)
    host_cache_bytes = _Setting[int]()
    poison_on_resume = _Setting[bool]()
    status = _Method(MemorySaver.status)
    guard = _Method(MemorySaver.guard)
    verify_wake = _Setting[bool]()
    stray_access = _Setting[StrayAccessMode]()
    soft_pause = _Setting[bool]()
