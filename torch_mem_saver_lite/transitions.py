"""Pause and resume with the tags' hooks, as transactions.

Handed the native saver and the native call to make; owns the hooks registered for tags and
the rules that tie them to the real transitions:

- A tag's ``before_pause`` hooks run just before its memory is released, in registration
  order; its ``after_resume`` hooks after it is mapped again and restored, newest first.
- They alternate: once a tag's ``before_pause`` hooks ran, the tag *owes* exactly those
  hooks their ``after_resume`` (hooks registered while it is paused run from its next pause
  on; removed ones are skipped), and only a tag that owes them gets them. A hook that pauses
  or resumes other tags, even of the same call, never makes a hook run twice or on memory
  in the wrong state: each tag's state is read when its turn comes. A hook may not pause or
  resume its own tag (nor every tag) while its tag's hooks run: that is refused.
- Pauses and resumes whose selection has hooked tags hold one re-entrant lock, so they run
  one after another, each with its hooks around its own mapping change; a hook may pause or
  resume other tags itself (same thread), but must not wait for another thread's pause or
  resume of hooked tags. Selections without hooked tags take no lock.
- Failures lose nothing: a failed pause gives the hooks that ran their ``after_resume`` for
  the tags active again; a hook failing after a resume pauses the call's tags again (the
  hooks that ran get their ``before_pause``). A Ctrl-C during a pause's hooks undoes it like
  a failure (one after the native pause finished keeps the pause); one during a resume is
  held until every step of the resume ran, then raised. Each step and the record of it
  happen together, and undoing is not cut short (``interrupts.deferred``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import _lib, interrupts
from .errors import MemorySaverError

Hook = Callable[[], object]


@dataclass(frozen=True, eq=False)  # one registration, compared by identity
class TagHooks:
    before_pause: Hook | None
    after_resume: Hook | None


def _run_quietly(hooks: Iterable[Hook | None]) -> None:
    """Undo hooks while an exception is already on its way: one that fails too is reported
    as a warning rather than hiding the original error."""
    for hook in hooks:
        if hook is None:
            continue
        try:
            hook()
        except Exception as error:  # noqa: BLE001 - the original error is what propagates
            warnings.warn(f"torch_mem_saver_lite: a hook failed while undoing a failed pause/resume: "
                          f"{error!r}", RuntimeWarning, stacklevel=3)


def _step(call: Hook | None, record: Callable[[], None]) -> None:
    """``call()`` then ``record()``, as one step for a Ctrl-C: held until both are done. A
    KeyboardInterrupt raised by the call itself counts the step as done (never run twice)."""
    with interrupts.deferred():
        try:
            if call is not None:
                call()
        except KeyboardInterrupt:
            record()
            raise
        record()


def _move_first(left: list[TagHooks], ran: list[tuple[str, TagHooks]], tag: str) -> None:
    ran.append((tag, left.pop(0)))


class Transitions:
    """The hooks of one saver's tags and the runner of its pauses and resumes."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._hooks: dict[str, list[TagHooks]] = {}
        # tag -> the hooks whose before_pause ran, whose after_resume is owed
        self._owing: dict[str, list[TagHooks]] = {}
        self._busy: set[str] = set()  # tags whose own hooks are running now

    # ----- registry ------------------------------------------------------------------------
    def register(self, tag: str, before_pause: Hook | None, after_resume: Hook | None) -> Callable[[], None]:
        """Add hooks for ``tag``; returns the function that removes them."""
        entry = TagHooks(before_pause, after_resume)
        with self._lock:
            self._hooks.setdefault(tag, []).append(entry)

        def remove() -> None:
            with self._lock:
                if entry in self._hooks.get(tag, []):
                    self._hooks[tag].remove(entry)
        return remove

    def _of(self, tag: str) -> list[TagHooks]:
        """The hooks a pause of ``tag`` runs now."""
        return list(self._hooks.get(tag, ()))

    def _due(self, tag: str) -> list[TagHooks]:
        """The hooks a resume of ``tag`` runs: those whose before_pause ran (and that are
        still registered)."""
        registered = self._hooks.get(tag, ())
        return [h for h in self._owing.get(tag, ()) if h in registered]

    def _hooked(self, names: list[str] | None) -> list[str]:
        """The tags of the selection (None: all) that have hooks or owe them, in the
        selection's order."""
        # Copies taken in one C call each: the lock-free path reads while others register.
        hooked = {t for t, hooks in list(self._hooks.items()) if hooks} | set(self._owing)
        return [t for t in dict.fromkeys(names if names is not None else sorted(hooked)) if t in hooked]

    def _refuse_busy(self, names: list[str] | None) -> None:
        """A hook may pause or resume other tags, but not its own tag (nor every tag) while
        that tag's hooks are running."""
        busy = sorted(self._busy if names is None else self._busy.intersection(names))
        if busy:
            raise MemorySaverError(f"tag {busy[0]!r} is running its own hooks: a hook may pause or resume other "
                                   "tags, not its own tag nor every tag")

    def _ran_before_pause(self, ran: list[tuple[str, TagHooks]], tag: str, hooks: TagHooks) -> None:
        ran.append((tag, hooks))
        self._owing[tag].append(hooks)

    def held(self) -> threading.RLock:
        """The lock hooked transitions hold, for work that must not overlap one (a ``with``
        block)."""
        return self._lock

    # ----- transitions ---------------------------------------------------------------------
    def pause(self, native: _lib.NativeSaver, names: list[str] | None,
              do_pause: Callable[[list[str] | None], None]) -> None:
        """Run the before_pause hooks of the selected tags that are active, then
        ``do_pause(names)`` (the native pause)."""
        if not self._hooked(names):
            do_pause(names)  # no hooks involved: no lock
            return
        with self._lock:
            self._refuse_busy(names)
            started: list[str] = []  # tags whose hooks this call began
            ran: list[tuple[str, TagHooks]] = []
            done = [False]
            try:
                for tag in self._hooked(names):
                    if tag in self._owing or native.tag_state(tag) != _lib.TAG_ACTIVE:
                        continue  # hooked by an enclosing call already, or not active now
                    with interrupts.deferred():
                        self._owing[tag] = []
                        self._busy.add(tag)
                        started.append(tag)
                    for hooks in self._of(tag):
                        _step(hooks.before_pause, functools.partial(self._ran_before_pause, ran, tag, hooks))
                    self._busy.discard(tag)
                _step(functools.partial(do_pause, names), functools.partial(done.__setitem__, 0, True))
            except BaseException:
                self._busy.difference_update(started)
                if done[0]:
                    raise  # the pause happened; only an interrupt came after it
                # Nothing is lost: memory a failed pause released comes back, then the hooks
                # that ran are undone, newest first, for the tags that are active again (one
                # whose memory cannot come back stays paused and owes its after_resume).
                with interrupts.deferred():  # a Ctrl-C does not cut the undo short
                    if started:
                        with contextlib.suppress(Exception):  # the original error is what propagates
                            native.resume(started)
                    active = {t for t in started if native.tag_state(t) == _lib.TAG_ACTIVE}
                    _run_quietly(hooks.after_resume for t, hooks in reversed(ran) if t in active)
                    for tag in active:
                        self._owing.pop(tag, None)
                raise

    def resume(self, native: _lib.NativeSaver, names: list[str] | None,
               do_resume: Callable[[list[str] | None], None]) -> None:
        """``do_resume(names)`` (the native resume), then the after_resume hooks of the
        selected tags that owe them and are active."""
        if not self._hooked(names):
            do_resume(names)  # no hooks involved: no lock
            return
        with self._lock:
            self._refuse_busy(names)
            paused_now = {t for t, figures in native.stats().items() if figures["paused"]}
            paused_before = [t for t in (names if names is not None else sorted(paused_now)) if t in paused_now]
            order = list(reversed(self._hooked(names)))
            resumed, position = [False], 0
            left: list[TagHooks] | None = None  # the current tag's hooks not run yet
            ran: list[tuple[str, TagHooks]] = []
            finished: list[str] = []  # tags whose after_resume hooks all ran
            interrupt: BaseException | None = None
            while True:
                try:
                    if not resumed[0]:
                        _step(functools.partial(do_resume, names), functools.partial(resumed.__setitem__, 0, True))
                    while position < len(order):
                        tag = order[position]
                        if left is None:
                            if tag not in self._owing or native.tag_state(tag) != _lib.TAG_ACTIVE:
                                position += 1
                                continue
                            with interrupts.deferred():
                                left = list(reversed(self._due(tag)))
                                self._busy.add(tag)
                        while left:
                            _step(left[0].after_resume, functools.partial(_move_first, left, ran, tag))
                        with interrupts.deferred():
                            self._owing.pop(tag, None)
                            self._busy.discard(tag)
                            finished.append(tag)
                            left, position = None, position + 1
                    break
                except KeyboardInterrupt as error:
                    interrupt = interrupt or error  # every step still runs; raised at the end
                except BaseException:
                    if position < len(order):
                        self._busy.discard(order[position])
                    if not resumed[0]:
                        raise  # nothing was resumed: nothing to undo
                    with interrupts.deferred():  # a Ctrl-C does not cut the undo short
                        _run_quietly(hooks.before_pause for _, hooks in reversed(ran))
                        for tag in finished:  # owed again: what ran for it
                            self._owing[tag] = [h for t, h in ran if t == tag]
                        native.pause(paused_before)
                    raise
            if interrupt is not None:
                raise interrupt
