"""Ctrl-C held back while a step and the record of it are made together.

Python raises KeyboardInterrupt between any two bytecodes of the main thread, so "call the
hook, then note that it ran" can be cut between the two halves; the undo logic would then
undo a step that never ran or skip one that did. ``deferred()`` makes such a group of
statements all-or-nothing with respect to a real SIGINT: the signal's handler is swapped for
one that only records it, and the original handler is called when the block ends. A
second SIGINT inside the block is delivered at once: pressing Ctrl-C twice still stops a
step that hangs.

Only the main thread receives SIGINT, so elsewhere the block runs as is. Blocks nest (the
outermost one delivers). A block holds Ctrl-C only as long as it runs: keep it to one step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

_depth = threading.local()  # nesting of deferred() blocks on this thread


class deferred:  # noqa: N801 - used like a function: `with interrupts.deferred():`
    """Hold SIGINT for the block; deliver it (call the original handler) at the end."""

    __slots__ = ("_previous", "_pending")

    def __init__(self) -> None:
        self._previous: Any = None
        self._pending: tuple[int, FrameType | None] | None = None

    def __enter__(self) -> None:
        # The handler is swapped before the depth is counted: a signal before the swap
        # raises here, with nothing changed; one after it is recorded.
        depth = getattr(_depth, "n", 0)
        if not depth and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # SIG_IGN / SIG_DFL: nothing Python would raise
                self._previous = previous
                signal.signal(signal.SIGINT, self._record)
        _depth.n = depth + 1

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._pending is None:
            self._pending = (signum, frame)
            return
        # A second Ctrl-C: the user insists (a hook or a collective that hangs), so it is
        # delivered now, in the middle of the block, with the original handler back.
        previous, self._previous, self._pending = self._previous, None, None
        signal.signal(signal.SIGINT, previous)
        previous(signum, frame)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        _depth.n -= 1
        previous, self._previous = self._previous, None
        if previous is None:
            return
        if signal.getsignal(signal.SIGINT) == self._record:  # one installed inside the block stays
            signal.signal(signal.SIGINT, previous)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            previous(*pending)  # the default handler raises KeyboardInterrupt here


def active() -> bool:
    """Whether this thread is inside a ``deferred()`` block."""
    return getattr(_depth, "n", 0) > 0
