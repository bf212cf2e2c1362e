"""Disk backup's Python side: the directory a program chose, handed to the core.

The core's disk tier (``csrc/tiers/disk_tier.h``) does the rest: a pause writes each
disk-backed allocation (``enable_disk_backup=True``, and what the node's host-memory budget
cannot hold) to a file of its own in the directory, before anything is released; a resume
reads the files back and removes them; a free, the saver's end and the process's exit remove
them too, and the next process choosing the directory removes those of processes killed
before they could. Here: the program's choice, kept until the core exists (a directory given
earlier is checked at once by the core's own checks, without starting the driver), the
environment's directory where the program chose none, and what the tier has to tell, logged.
"""

from __future__ import annotations

import logging
import os

from . import _lib
from .errors import MemorySaverError

logger = logging.getLogger("torch_mem_saver_lite")

NEEDS_DIRECTORY = ("enable_disk_backup=True needs a directory: call set_disk_backup_dir(path) or set "
                   "TMSL_DISK_BACKUP_DIR")


class DiskDirectory:
    """A saver's disk backup directory as the program chose it, and the core's as it is."""

    def __init__(self) -> None:
        # The program's choice: a real path, "" for none (not the environment's either), None
        # for no choice (the environment's, which the core takes itself where it can).
        self._chosen: str | None = None
        self._problem = ""  # why the environment's directory cannot serve, naming the variable
        self.active = False  # the core has a directory: its notices are worth asking for

    def choose(self, path: str | os.PathLike[str] | None, native: _lib.NativeSaver | None) -> None:
        """``set_disk_backup_dir``: checked now (made if missing), stale files removed once
        the core has it; None: none."""
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"the disk backup directory must be a path, got {type(path).__name__}")
        text = os.fsdecode(path) if path is not None else ""
        if path is not None and not text:
            raise ValueError("the disk backup directory must be a path, got ''; None turns disk backup off")
        if native is None:
            chosen, notices = _lib.check_disk_backup_dir(text) if text else ("", [])
            for notice in notices:
                logger.warning("%s", notice)
        else:
            native.set_option("disk_backup_dir", text)
            chosen = native.option("disk_backup_dir")
            self.active = bool(chosen)
            self.tell(native)
        self._chosen, self._problem = chosen, ""

    def apply(self, native: _lib.NativeSaver, environment: tuple[str, str] | None) -> None:
        """A core was made or found: the program's choice, else the environment's."""
        if self._chosen is not None:
            native.set_option("disk_backup_dir", self._chosen)
        elif environment is not None and not native.option("disk_backup_dir"):
            # The core could not take it: this says why.
            try:
                native.set_option("disk_backup_dir", environment[1])
            except MemorySaverError as error:
                self._problem = f"{environment[0]}: {error}"
                logger.warning("no disk tier for the node's host-memory budget: %s", self._problem)
        self.active = bool(native.option("disk_backup_dir"))
        self.tell(native)

    def require(self, native: _lib.NativeSaver) -> None:
        """A disk-backed region is opening: refused without a directory, saying what to do."""
        if not native.option("disk_backup_dir"):
            raise MemorySaverError(self._problem or NEEDS_DIRECTORY)

    def tell(self, native: _lib.NativeSaver | None) -> None:
        """Log what the core's disk tier has to tell (stale files removed, O_DIRECT refused,
        what the budget sent to disk)."""
        if native is not None and self.active:
            for notice in native.disk_notices():
                logger.warning("%s", notice)

    def named(self, native: _lib.NativeSaver | None, environment: tuple[str, str] | None) -> str:
        """The directory the core has, else (no core yet) the one it will take; "" for none.
        Changes nothing."""
        if native is not None:
            return native.option("disk_backup_dir")
        if self._chosen is not None:
            return self._chosen
        return environment[1] if environment is not None and not self.problem(None, environment) else ""

    def problem(self, native: _lib.NativeSaver | None, environment: tuple[str, str] | None) -> str:
        """Why the environment's directory cannot serve, naming the variable ("" where it can,
        or where the program chose). Changes nothing."""
        if self._chosen is not None or environment is None:
            return ""
        if native is not None:
            return self._problem
        try:
            _lib.check_disk_backup_dir(environment[1], make=False)
        except MemorySaverError as error:
            return f"{environment[0]}: {error}"
        return ""
