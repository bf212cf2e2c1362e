"""Pause and resume with the tags' hooks, as transactions.

Handed the native saver and the native call to make; owns the hooks registered for tags and
the rules that tie them to the real transitions:

- A tag's ``before_pause`` hooks run just before its memory is released, in registration
  order; its ``after_resume`` hooks after it is mapped again and restored, newest first.
- They alternate: once a tag's ``before_pause`` hooks ran, the tag *owes* its
  ``after_resume`` hooks, and only a tag that owes them gets them. A hook that pauses or
  resumes other tags (even of the same call) therefore never makes a hook run twice or on
  memory in the wrong state: each tag's state is read when its turn comes.
- Transitions that run hooks hold one re-entrant lock: concurrent pauses and resumes of
  hooked tags happen one after another, each with its hooks around its own mapping change. A
  hook may pause or resume tags itself (same thread); it must not wait for another thread's
  pause or resume. Without any hook registered, calls take no lock.
- Failures lose nothing: a failed pause gives the hooks that ran their ``after_resume`` for
  the tags active again; a hook failing after a resume pauses the call's tags again (the
  hooks that ran get their ``before_pause``). A Ctrl-C during a pause undoes it like a
  failure; one during a resume is held until every step of the resume ran, then raised.
  Each step and the record of it happen together (``interrupts.deferred``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from . import _lib, interrupts

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

    def __init__(self, innermost: Mapping[str, TagHooks]):
        """``innermost``: tag -> hooks that run after the user's before_pause hooks and
        before their after_resume hooks (the disk backup: they then see the content)."""
        self._lock = threading.RLock()
        self._hooks: dict[str, list[TagHooks]] = {}
        self._innermost = innermost
        self._owing: set[str] = set()  # tags whose before_pause hooks ran, after_resume not yet

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
        innermost = self._innermost.get(tag)
        return [*self._hooks.get(tag, ()), *([innermost] if innermost is not None else [])]

    def _any(self) -> bool:
        return bool(self._owing or self._innermost or any(self._hooks.values()))

    def _hooked(self, names: list[str] | None) -> list[str]:
        """The tags of the selection (None: all) that have hooks, in the selection's order."""
        hooked = {t for t, hooks in self._hooks.items() if hooks} | set(self._innermost) | self._owing
        return [t for t in dict.fromkeys(names if names is not None else sorted(hooked)) if t in hooked]

    # ----- transitions ---------------------------------------------------------------------
    def pause(self, native: _lib.NativeSaver, names: list[str] | None, do_pause: Callable[[], None]) -> None:
        """Run the before_pause hooks of the selected tags that are active, then
        ``do_pause()`` (the native pause of ``names``)."""
        if not self._any():
            do_pause()
            return
        with self._lock:
            started: list[str] = []  # tags whose hooks this call began
            ran: list[tuple[str, TagHooks]] = []
            try:
                for tag in self._hooked(names):
                    if tag in self._owing or native.tag_state(tag) != _lib.TAG_ACTIVE:
                        continue  # hooked by an enclosing call already, or not active now
                    with interrupts.deferred():
                        self._owing.add(tag)
                        started.append(tag)
                    for hooks in self._of(tag):
                        _step(hooks.before_pause, functools.partial(ran.append, (tag, hooks)))
                with interrupts.deferred():
                    do_pause()
            except BaseException:
                # Nothing is lost: memory a failed pause released comes back, then the hooks
                # that ran are undone, newest first, for the tags that are active again (one
                # whose memory cannot come back stays paused and owes its after_resume).
                if started:
                    with contextlib.suppress(Exception):  # the original error is what propagates
                        native.resume(started)
                active = {t for t in started if native.tag_state(t) == _lib.TAG_ACTIVE}
                _run_quietly(hooks.after_resume for t, hooks in reversed(ran) if t in active)
                self._owing -= active
                raise

    def resume(self, native: _lib.NativeSaver, names: list[str] | None, do_resume: Callable[[], None]) -> None:
        """``do_resume()`` (the native resume of ``names``), then the after_resume hooks of
        the selected tags that owe them and are active."""
        if not self._any():
            do_resume()
            return
        with self._lock:
            paused_now = {t for t, figures in native.stats().items() if figures["paused"]}
            paused_before = [t for t in (names if names is not None else sorted(paused_now)) if t in paused_now]
            order = list(reversed(self._hooked(names)))
            resumed, position = [False], 0
            left: list[TagHooks] | None = None  # the current tag's hooks not run yet
            ran: list[tuple[str, TagHooks]] = []
            interrupt: BaseException | None = None
            while True:
                try:
                    if not resumed[0]:
                        _step(do_resume, functools.partial(resumed.__setitem__, 0, True))
                    while position < len(order):
                        tag = order[position]
                        if left is None:
                            if tag not in self._owing or native.tag_state(tag) != _lib.TAG_ACTIVE:
                                position += 1
                                continue
                            left = list(reversed(self._of(tag)))
                        while left:
                            hooks = left[0]
                            _step(hooks.after_resume, functools.partial(_move_first, left, ran, tag))
                        with interrupts.deferred():
                            self._owing.discard(tag)
                            left, position = None, position + 1
                    break
                except KeyboardInterrupt as error:
                    interrupt = interrupt or error  # every step still runs; raised at the end
                except BaseException:
                    if not resumed[0]:
                        raise  # nothing was resumed: nothing to undo
                    _run_quietly(hooks.before_pause for _, hooks in reversed(ran))
                    self._owing.update(t for t, _ in ran)
                    native.pause(paused_before)
                    raise
            if interrupt is not None:
                raise interrupt
