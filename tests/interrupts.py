"""Injecting a KeyboardInterrupt at a chosen line the library executes (sys.settrace): the
tests and the host soak use it to interrupt region(), disable(), paused() and disk-backed
pauses and resumes anywhere. Only the calling thread is traced: Python raises Ctrl-C on the
main thread only, never in the disk backup's worker threads."""

from __future__ import annotations

import sys

from torch_mem_saver_lite import disk_backup, memory_saver

LIBRARY_FILES = (memory_saver.__file__, disk_backup.__file__)


def interrupted_at(k: int, body, files=LIBRARY_FILES) -> bool:
    """Run body() with a KeyboardInterrupt raised at the k-th line the library executes
    (the lines of ``files``); True if it was raised (False: body finished before line k)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count == k:
                raise KeyboardInterrupt(f"injected at line {frame.f_lineno} of {frame.f_code.co_name}")
        return local

    def tracer(frame, event, arg):
        # Not in finalizers: the garbage collector runs them whenever it likes (an _Undo of an
        # earlier round, say), and Python swallows what they raise, so a count that reached k
        # there would interrupt nothing and end the test's walk early.
        if frame.f_code.co_name == "__del__":
            return None
        return local if frame.f_code.co_filename in files else None

    sys.settrace(tracer)
    try:
        body()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False
