"""The disk tier of the node's host-memory budget, around one pause.

Where a disk backup directory is set, what the budget cannot hold goes to disk files instead
of host memory: the core marks those allocations (``mark_spill``), their tags get the disk
backup's hooks, which write the files before the memory is released. Should the other
processes' caches not come back in time, the pause is tried once more with all its backups
on disk. Without a directory, or when the tier cannot take the rest, the core's refusal is
raised with what to do."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from . import _lib
from .disk_backup import DiskBackups
from .errors import OutOfMemoryError

NativePause = Callable[[list[str] | None], None]


def pause(native: _lib.NativeSaver, names: list[str] | None, disk: DiskBackups,
          from_environment: Callable[[], tuple[str, str] | None], lock: threading.RLock,
          run: Callable[[NativePause], None]) -> None:
    """``run(native_pause)`` (the pause with its hooks), within the budget's disk tier."""
    refused: list[OutOfMemoryError] = []  # the native pause's own refusals: host memory

    def native_pause(selection: list[str] | None) -> None:
        try:
            native.pause(selection)
        except OutOfMemoryError as error:
            refused.append(error)
            raise

    spilling = disk.configured(from_environment)
    try:
        if spilling:
            _mark(native, names, disk, lock, everything=False)
        else:
            native.unmark_spill(names)  # marks left by an earlier pause are stale now
        try:
            run(native_pause)
        except OutOfMemoryError as error:
            if not (spilling and error in refused and _mark(native, names, disk, lock, everything=True)):
                raise
            run(native_pause)  # what the others' caches did not free in time goes to disk too
    except OutOfMemoryError as error:
        native.unmark_spill(names)  # resident again: backed up to host memory from the next pause
        if not refused or error is not refused[-1]:
            raise
        raise _with_hint(error, disk.named_directory(from_environment)) from None
    except BaseException:
        native.unmark_spill(names)
        raise


@contextlib.contextmanager
def hinted_refusals() -> Iterator[None]:
    """Where the tier is not in use (no directory, no marks), around a pause: the native
    pause's own refusal for want of host memory says what would take the rest; a refusal a
    hook raised passes as it is."""
    try:
        yield
    except OutOfMemoryError as error:
        if not _raised_by_native_pause(error):
            raise
        raise _with_hint(error, "") from None


def _raised_by_native_pause(error: BaseException) -> bool:
    codes = []
    trace = error.__traceback__
    while trace is not None:
        codes.append(trace.tb_frame.f_code)
        trace = trace.tb_next
    return codes[-2:] == [_lib.NativeSaver.pause.__code__, _lib.check.__code__]


def _mark(native: _lib.NativeSaver, names: list[str] | None, disk: DiskBackups, lock: threading.RLock,
          everything: bool) -> bool:
    """Marks what the budget cannot hold (``everything``: all backups of the pause) for disk
    backup; whether anything was marked."""
    spilled = native.mark_spill(names, everything)  # waits for other pauses: not under the lock
    if spilled:
        with lock:
            disk.take_spilled(native, names, spilled)
    return spilled > 0


def _with_hint(error: OutOfMemoryError, directory: str) -> OutOfMemoryError:
    """The native pause's refusal for want of host memory, with what the disk tier did."""
    hint = (f"; the disk tier ({directory}) could not take the rest: a tag paused in part (or whose last resume "
            "was undone) keeps host backups, as its files cannot be written now; resume it, then pause again"
            if directory else
            "; or set a disk backup directory (set_disk_backup_dir or TMSL_DISK_BACKUP_DIR): what the budget "
            "cannot hold then goes to disk")
    return OutOfMemoryError(f"{error}{hint}", error.tag, error.bytes_needed, error.bytes_free, error.device)
