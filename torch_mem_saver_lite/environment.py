"""Process defaults read from the environment on the Python side.

Each setting has our ``TMSL_*`` name and torch_memory_saver's ``TMS_*`` name, with the same
meaning; setting both to different values is an error. (The native library reads the
defaults its allocation hooks need itself: ``TMSL_REGION_ALL_THREADS`` / ``TMS_INIT_ENABLE``,
``TMSL_DEFAULT_CPU_BACKUP`` / ``TMS_INIT_ENABLE_CPU_BACKUP``, ``TMSL_DEFAULT_TAG``,
``TMSL_POISON_ON_RESUME``.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import MemorySaverError

CPU_BACKUP_BACKENDS = ("pinned", "mmap")


def _setting(ours: str, theirs: str) -> tuple[str, str] | None:
    """(name, value) of the variable that is set, or None; both set must agree."""
    values = [(name, os.environ[name]) for name in (ours, theirs) if os.environ.get(name)]
    if len(values) == 2 and values[0][1] != values[1][1]:
        raise MemorySaverError(f"{ours}={values[0][1]!r} and {theirs}={values[1][1]!r} disagree; "
                               "set one of them")
    return values[0] if values else None


def _parse_flag(name: str, value: str) -> bool:
    # The spellings the native library accepts for its own flags (thread_region.cpp).
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise MemorySaverError(f"{name} must be 0 or 1, got {value!r}")


def _flag(ours: str, theirs: str) -> bool:
    values = {name: _parse_flag(name, os.environ[name]) for name in (ours, theirs) if os.environ.get(name)}
    if len(set(values.values())) > 1:
        raise MemorySaverError(f"{ours}={os.environ[ours]!r} and {theirs}={os.environ[theirs]!r} disagree; "
                               "set one of them")
    return any(values.values())


@dataclass(frozen=True)
class EnvironmentDefaults:
    retain_cpu_backup: bool
    disk_backup_dir: tuple[str, str] | None  # (variable, path): checked when first used
    default_tag: str  # the tag of the preload-mode process region
    default_cpu_backup_backend: str | None
    default_disk_backup: bool


def read() -> EnvironmentDefaults:
    """The defaults, or MemorySaverError naming the variable that is wrong."""
    backend = _setting("TMSL_DEFAULT_CPU_BACKUP_BACKEND", "TMS_INIT_CPU_BACKUP_BACKEND")
    if backend is not None and backend[1] not in CPU_BACKUP_BACKENDS:
        raise MemorySaverError(f"{backend[0]} must be one of {', '.join(CPU_BACKUP_BACKENDS)}, got {backend[1]!r}")
    disk = _flag("TMSL_DEFAULT_DISK_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP")
    cpu = _flag("TMSL_DEFAULT_CPU_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP")
    if disk and cpu:
        raise MemorySaverError("disk backup and CPU backup of the default region exclude each other: "
                               "set only one of TMS_INIT_ENABLE_DISK_BACKUP and TMS_INIT_ENABLE_CPU_BACKUP")
    return EnvironmentDefaults(
        retain_cpu_backup=_flag("TMSL_RETAIN_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP"),
        disk_backup_dir=_setting("TMSL_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR"),
        default_tag=os.environ.get("TMSL_DEFAULT_TAG") or "default",
        default_cpu_backup_backend=backend[1] if backend is not None else None,
        default_disk_backup=disk,
    )
