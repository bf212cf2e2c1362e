"""Per-tag memory figures returned by ``saver.stats()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TagStats:
    """What one tag holds right now.

    Attributes:
        allocations: live allocations made in the tag's regions.
        reserved_bytes: virtual address space they reserve (device memory when resident).
        resident_bytes: bytes backed by device memory now.
        paused_bytes: bytes whose device memory is released (reserved - resident).
        host_backup_bytes: host memory holding paused content.
    """

    allocations: int = 0
    reserved_bytes: int = 0
    resident_bytes: int = 0
    paused_bytes: int = 0
    host_backup_bytes: int = 0

    @classmethod
    def from_native(cls, fields: dict[str, int]) -> TagStats:
        return cls(**{name: int(fields.get(name, 0)) for name in cls.__dataclass_fields__})
