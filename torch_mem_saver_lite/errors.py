"""Exceptions raised by torch_mem_saver_lite."""

from __future__ import annotations

import torch


class MemorySaverError(RuntimeError):
    """A torch_mem_saver_lite operation failed; the message says what and what to do."""


class DriverNotFoundError(MemorySaverError):
    """No usable CUDA driver (libcuda.so.1) is on this machine."""


class CudaDriverError(MemorySaverError):
    """The CUDA driver reported an error."""


class InvalidArgumentError(MemorySaverError, ValueError):
    """The native library rejected an argument (an unknown pointer, say)."""


class WakeVerificationError(MemorySaverError):
    """A resume restored bytes other than the pause saw (``verify_wake``): a backup was changed
    or damaged while paused. The message names the tag, the allocation and where in it; nothing
    was woken: everything that resume covered stays paused with its backups as they are.
    """


class PausedTensorError(MemorySaverError):
    """Inside ``saver.guard()``, an op was about to touch memory of a paused tag; it did not
    run. Attribute ``tag``: the paused tag."""

    def __init__(self, message: str, tag: str):
        super().__init__(message)
        self.tag = tag


class StrayAccessError(MemorySaverError):
    """Raised by a resume (with ``stray_access="raise"``) that found writes made into a tag's
    paused memory without a backup: something still used it while it was paused. The resume
    itself succeeded: the tags it named are awake, their hooks ran. Attribute ``tags``: the
    tags written to, with how many checks found writes ({tag: count})."""

    def __init__(self, message: str, tags: dict[str, int]):
        super().__init__(message)
        self.tags = tags


class StrayAccessWarning(UserWarning):
    """What a resume warns (``stray_access="warn"``, the default) where it found writes made
    into a tag's paused memory without a backup; the message names the tag."""


class OutOfMemoryError(MemorySaverError, torch.cuda.OutOfMemoryError):
    """An allocation or a resume found too little free memory.

    A failed resume leaves everything it covered paused, with its backups; call
    ``resume`` again once memory has been freed.

    Attributes:
        tag: the region that could not get its memory.
        bytes_needed: bytes the call needed on ``device``.
        bytes_free: bytes free on ``device`` when it failed.
        device: the device index.
    """

    def __init__(self, message: str, tag: str, bytes_needed: int, bytes_free: int, device: int):
        super().__init__(message)
        self.tag = tag
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free
        self.device = device
