"""Injecting a KeyboardInterrupt at a chosen line the library executes (sys.settrace): the
tests and the host soak use it to interrupt region(), disable(), paused() and disk-backed
pauses and resumes anywhere. The interrupt is a real SIGINT, so it is held where the library
holds real ones. Only the calling thread is traced, and it must be the main thread: Python
raises Ctrl-C there only."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from torch_mem_saver_lite import disk_backup, memory_saver, regions, transitions

LIBRARY_FILES = (memory_saver.__file__, regions.__file__, transitions.__file__, disk_backup.__file__)


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the block, as in a foreground shell. A background
    job of a non-interactive shell (`setsid make test &`, nohup, some CI runners) starts with
    SIGINT ignored, which its children inherit: there a real SIGINT would do nothing at all.
    conftest.py puts every test inside this block; interrupted_at enters it too, for the
    programs the tests start."""
    previous = signal.getsignal(signal.SIGINT)
    swap = not callable(previous) and threading.current_thread() is threading.main_thread()
    if swap:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if swap:
            signal.signal(signal.SIGINT, previous)


def _inside_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def interrupted_at(k: int, body, files=LIBRARY_FILES) -> bool:
    """Run body() with a KeyboardInterrupt raised at the k-th line the library executes
    (the lines of ``files``); True if it was raised (False: body finished before line k)."""
    for _ in range(5):
        with sigint_raises():
            outcome = _run_interrupted_at(k, body, files)
        if outcome is not None:
            return outcome
    raise AssertionError(f"the interrupt at line {k} was swallowed by a finalizer five times in a row")


def _run_interrupted_at(k: int, body, files) -> bool | None:
    """True: interrupted; False: finished before line k; None: the k-th line ran inside a
    finalizer the garbage collector happened to run (an abandoned generator of an earlier
    round closing, say), which swallows what is raised there, so the round tells nothing."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count == k:
                # A real SIGINT, delivered as Python delivers it: KeyboardInterrupt here, or
                # recorded and raised later inside the library's interrupts.deferred() blocks.
                signal.raise_signal(signal.SIGINT)
        return local

    def tracer(frame, event, arg):
        # Not in __del__ nor what it calls: Python swallows what they raise.
        if frame.f_code.co_filename not in files or _inside_finalizer(frame):
            return None
        return local

    sys.settrace(tracer)
    try:
        body()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False if count < k else None
