"""``torch_memory_saver``: torch_memory_saver's API over our saver, for frameworks that switch
without edits. Where the two tools differ on purpose, this object behaves like
torch_memory_saver (the README's difference table lists every case):

- ``pause``/``resume`` of a tag no region has used does nothing (``saver`` raises, naming
  the known tags: a typo there should not pass silently);
- ``cuda_graph``'s default tag is ``"default"`` (``saver``'s is ``"cuda_graph"``), so
  ``pause("default")`` covers graph memory, as it does there.

Everything else is ``saver`` itself: the same regions, tags, settings and state; attributes
torch_memory_saver lacks (``stats``, ``paused``, ...) are passed through.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .memory_saver import MemorySaver


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` over a MemorySaver."""

    def __init__(self, saver: MemorySaver):
        object.__setattr__(self, "_saver", saver)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._saver, name)

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool | None = None, enable_disk_backup: bool = False,
               cpu_backup_backend: str | None = None) -> Iterator[None]:
        with self._saver.region(tag, enable_cpu_backup=enable_cpu_backup, enable_disk_backup=enable_disk_backup,
                                cpu_backup_backend=cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None,
                   stream: torch.cuda.Stream | None = None, capture_error_mode: str = "global",
                   tag: str = "default", enable_cpu_backup: bool | None = None,
                   cpu_backup_backend: str | None = None) -> Iterator[None]:
        with self._saver.cuda_graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode,
                                    tag=tag, enable_cpu_backup=enable_cpu_backup,
                                    cpu_backup_backend=cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        with self._saver.disable():
            yield

    def _known(self, tag: str | Sequence[str] | None) -> list[str] | None:
        """The named tags that exist (None: every tag); unknown ones are dropped."""
        if tag is None:
            return None
        names = [tag] if isinstance(tag, str) else list(tag)
        known = set(self._saver.stats())
        return [name for name in names if name in known]

    def pause(self, tag: str | Sequence[str] | None = None) -> None:
        """Like ``saver.pause``; a tag no region has used is skipped, as torch_memory_saver does."""
        names = self._known(tag)
        if names != []:
            self._saver.pause(names)

    def resume(self, tag: str | Sequence[str] | None = None) -> None:
        """Like ``saver.resume``; a tag no region has used is skipped."""
        names = self._known(tag)
        if names != []:
            self._saver.resume(names)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        return self._saver.hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        self._saver.hook_mode = mode

    @property
    def memory_margin_bytes(self) -> int:
        return self._saver.memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, nbytes: int) -> None:
        self._saver.memory_margin_bytes = nbytes

    @property
    def retain_cpu_backup(self) -> bool:
        return self._saver.retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, retain: bool) -> None:
        self._saver.retain_cpu_backup = retain

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        return self._saver.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str | os.PathLike[str]) -> None:
        self._saver.set_disk_backup_dir(path)
