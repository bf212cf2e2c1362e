"""The string choices of the public API, each written once as a ``typing.Literal``: the
signatures take these types (so a type checker refuses ``cpu_backup_backend="pinnned"`` before
the code runs) and the argument checks take their values from them (``typing.get_args``)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["CaptureErrorMode", "CpuBackupBackend", "HookModeName", "StrayAccessMode"]

HookModeName = Literal["torch", "preload"]
"""How allocations are intercepted (``MemorySaver.hook_mode``)."""

CpuBackupBackend = Literal["pinned", "mmap"]
"""Where a region's host backups live between cycles (``region(..., cpu_backup_backend=)``)."""

StrayAccessMode = Literal["off", "warn", "raise"]
"""What a touch of paused memory without a backup meets (``MemorySaver.stray_access``)."""

CaptureErrorMode = Literal["global", "thread_local", "relaxed"]
"""``torch.cuda.graph``'s ``capture_error_mode``, passed on by ``cuda_graph``."""

HOOK_MODES: tuple[HookModeName, ...] = get_args(HookModeName)
CPU_BACKUP_BACKENDS: tuple[CpuBackupBackend, ...] = get_args(CpuBackupBackend)
STRAY_ACCESS_MODES: tuple[StrayAccessMode, ...] = get_args(StrayAccessMode)
