"""A saver's settings and the checks of what users pass in.

- Argument checks: each raises TypeError/ValueError naming the argument and what it takes.
- The process defaults from the environment, as the native library read them (it is the one
  reader for both languages; csrc/platform/environment.h lists the variables and their grammar). Each has our
  ``TMSL_*`` name and torch_memory_saver's ``TMS_*`` name, with the same meaning; both set to
  different values is an error.
- ``Settings``: the environment's defaults as a saver reads them, once. (What a program sets
  on a saver are its options: options.py.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from . import _lib
from .choices import CPU_BACKUP_BACKENDS
from .errors import InvalidArgumentError, MemorySaverError

_MAX_SIZE = (1 << 64) - 1  # what a size_t holds: larger values would wrap in the C ABI


# ----- argument checks ---------------------------------------------------------------------
def check_tag_text(tag: object) -> bytes:
    """``tag`` as UTF-8, else TypeError/ValueError; check_tag applies the rest of the rule."""
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, got {type(tag).__name__}")
    try:
        return tag.encode()
    except UnicodeEncodeError:
        raise ValueError(f"tag must be encodable as UTF-8, got {tag!r}") from None


def check_tag(tag: object) -> str:
    """``tag`` if it is a valid tag name, else TypeError/ValueError saying what is wrong. The
    rule itself (1 to 256 characters without NUL) is the core's, the same for every entry point."""
    encoded = check_tag_text(tag)
    tag = cast(str, tag)
    try:
        _lib.check_tag(encoded)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{error} ({tag[:40]!r}{'...' if len(tag) > 40 else ''})") from None
    return tag


def check_selection(tag: object) -> list[str] | None:
    """A pause/resume selection (a tag, a list of tags, None for every tag) as a list (None
    for every tag), each tag checked with the one rule (the C ABI would stop at a NUL)."""
    if tag is None:
        return None
    if isinstance(tag, str):
        names = [tag]
    elif isinstance(tag, (list, tuple, set, frozenset)):
        names = list(tag)
    else:
        raise TypeError(f"tag must be a str, a list of str or None, got {type(tag).__name__}")
    for name in names:
        check_tag(name)
    return names


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_bytes(value: object, name: str) -> int:
    """A byte count: TypeError for anything but an int (a bool, a float, "1G" included),
    ValueError for one a size_t cannot hold."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (bytes), got {type(value).__name__} {value!r}")
    if not 0 <= value <= _MAX_SIZE:
        raise ValueError(f"{name} must be an int from 0 to 2**64 - 1, got {value!r}")
    return value


def check_backend(backend: object, backup: bool | None) -> bool | None:
    """cpu_backup_backend as "may the tag's backups stay in the host cache" (None: not given)."""
    if backend is None:
        return None
    if backend not in CPU_BACKUP_BACKENDS:
        raise ValueError(f"cpu_backup_backend must be one of {', '.join(map(repr, CPU_BACKUP_BACKENDS))} "
                         f"or None, got {backend!r}")
    if backup is not True:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
    return backend == "pinned"


def check_backup(value: object, name: str = "enable_cpu_backup") -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r}")
    return value


def backup_choice(enable_cpu_backup: object, enable_disk_backup: object, cpu_backup_backend: object,
                  default_caches: Callable[[], bool | None]) -> int:
    """A region's backup settings, checked, as the C ABI's choice (_lib.backup_choice).
    ``default_caches()``: the environment's backend for backed-up regions that name none
    (asked only then)."""
    backup = check_backup(enable_cpu_backup)
    disk = check_bool(enable_disk_backup, "enable_disk_backup")
    caches = check_backend(cpu_backup_backend, backup)
    if disk and backup:
        raise ValueError("enable_cpu_backup=True and enable_disk_backup=True exclude each other")
    if caches is None and backup is True:
        caches = default_caches()
    return _lib.backup_choice(backup, caches is not False, disk)


# ----- the environment ---------------------------------------------------------------------
@dataclass(frozen=True)
class EnvironmentDefaults:
    disk_backup_dir: tuple[str, str] | None  # (variable, path): checked when first used
    default_tag: str  # the tag of the preload-mode process region
    default_caches_backups: bool  # False: the default backend is "mmap"
    default_disk_backup: bool
    like_torch_memory_saver: bool  # TMSL_LIKE_TORCH_MEMORY_SAVER: the core's defaults are torch_memory_saver's


def read_environment() -> EnvironmentDefaults:
    """The process defaults as the native library read them (the one reader of the
    TMSL_*/TMS_* variables for both languages), or MemorySaverError naming what is wrong."""
    error = _lib.process_defaults_error()
    if error:
        raise MemorySaverError(error)
    d = _lib.process_defaults()
    variable = d.disk_backup_dir_variable.decode()
    return EnvironmentDefaults(
        disk_backup_dir=(variable, os.fsdecode(d.disk_backup_dir)) if variable else None,
        default_tag=d.tag.decode(),
        default_caches_backups=bool(d.caches_backups),
        default_disk_backup=d.backup_choice == _lib.CHOICE_DISK,
        like_torch_memory_saver=bool(d.like_torch_memory_saver),
    )


# ----- settings ----------------------------------------------------------------------------
class Settings:
    """A saver's reading of the environment: the TMSL_*/TMS_* defaults the native library
    read, taken once at first use. (The switches a program sets are options:
    options.py.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Read at first use: a bad value must not break the import, and a program may set
        # the variables after importing us.
        self._environment: EnvironmentDefaults | None = None

    def environment(self) -> EnvironmentDefaults:
        """The TMSL_*/TMS_* defaults, read once; MemorySaverError names a bad variable."""
        with self._lock:
            if self._environment is None:
                self._environment = read_environment()
            return self._environment

    def default_caches(self) -> bool | None:
        """TMS_INIT_CPU_BACKUP_BACKEND / TMSL_DEFAULT_CPU_BACKUP_BACKEND for backed-up regions
        that name no backend: False for "mmap", else None (the default, "pinned")."""
        return None if self.environment().default_caches_backups else False
