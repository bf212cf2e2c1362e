"""Disk backup's files as the tests see them from outside, for the tests of disk backup
(features) and of its processes forking and dying (robustness)."""

from __future__ import annotations

import os
import re
from pathlib import Path

NAME = re.compile(r"tmsl-(\d+)-(\d+)-([0-9a-f]{8})-(.+)-dev(\d+)-([0-9a-f]+)\.bin")


def files_in(directory: Path) -> dict[str, int]:
    """name -> size of the files in ``directory`` (none if it does not exist)."""
    if not directory.is_dir():
        return {}
    return {name: (directory / name).stat().st_size for name in os.listdir(directory)}


# A child that says so once its tag is paused, then waits for a line on stdin (after the
# children's prelude).
PAUSED_CHILD = """
    saver, mem = HostSaver(), HostMemory()
    saver.set_disk_backup_dir({directory!r})
    with saver.region("kv", enable_disk_backup=True):
        ptrs = [mem.malloc(2 << 20), mem.malloc(4 << 20)]
    mem.write(ptrs[0], b"child")
    saver.pause("kv")
    print("paused", flush=True)
    sys.stdin.readline()
    saver.resume("kv")
    print("resumed", mem.read(ptrs[0], 5) == b"child", flush=True)
"""


def pids_of(names) -> set[int]:
    return {int(NAME.fullmatch(name)[1]) for name in names}
