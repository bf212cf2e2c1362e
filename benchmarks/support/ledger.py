"""The node's host-memory ledger read from its file, outside the library (csrc/node_ledger.cpp's
layout: magic, budget, the pressure word, then per process pid, start time, held and cached
bytes), so a reader may follow any ledger whatever its own process opened."""

from __future__ import annotations

import struct
from pathlib import Path

HEADER_BYTES, SLOT_BYTES = 24, 32


def held_bytes(path: Path) -> int:
    """Host memory the ledger's processes hold (dead ones included until a process notices)."""
    data = path.read_bytes() if path.exists() else b""
    slots = data[HEADER_BYTES:]
    return sum(struct.unpack_from("<iIQQQ", slots, at)[3] for at in range(0, len(slots) - SLOT_BYTES + 1, SLOT_BYTES))
