"""The node's host-memory ledger read from its file, outside the library (csrc/node/node_ledger.cpp's
layout: magic, budget, the pressure word, then per process pid, start time, held and cached
bytes), so a reader may follow any ledger whatever its own process opened."""

from __future__ import annotations

import fcntl
import struct
from pathlib import Path

HEADER_BYTES, SLOT_BYTES = 24, 32


def held_bytes(path: Path) -> int:
    """Host memory the ledger's processes hold (dead ones included until a process notices),
    read under the file's lock as the library writes it. Only for a process that takes no part
    in that ledger: closing the file would drop its own slot's record lock."""
    if not path.exists():
        return 0
    with open(path, "rb") as file:
        fcntl.flock(file, fcntl.LOCK_SH)
        data = file.read()
    slots = data[HEADER_BYTES:]
    return sum(struct.unpack_from("<iIQQQ", slots, at)[3] for at in range(0, len(slots) - SLOT_BYTES + 1, SLOT_BYTES))
