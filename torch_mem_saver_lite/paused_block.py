"""The two ends of ``saver.paused()``: which tags the block pauses (those active now; a tag
no region used is refused as the core refuses it), and the exit that resumes them whatever happens."""

from __future__ import annotations

from collections.abc import Callable

from . import _lib, leftovers, nccl_suspend
from .errors import InvalidArgumentError


def active_tags(native: _lib.NativeSaver | None, names: list[str] | None) -> list[str]:
    """The tags of the selection (None: every tag) that are active now."""
    if native is None:
        return []  # no core: no tags, none unknown
    states = {t: native.tag_state(t) for t in (names if names is not None else list(native.stats()))}
    unknown = [t for t, state in states.items() if state == _lib.TAG_UNKNOWN]
    if unknown:
        # The words of the core's refusal of an unknown tag (Saver::check_known), before anything changes.
        known = ", ".join(f"'{t}'" for t in native.stats())
        raise InvalidArgumentError(f"unknown tag '{unknown[0]}': no region has used it; known tags: "
                                   f"{f'[{known}]' if known else 'none yet'}")
    return [t for t, state in states.items() if state == _lib.TAG_ACTIVE]


def resume_despite_interrupts(resume: Callable[[list[str]], None], tags: list[str],
                              suspended_before: set[str] | None = None) -> BaseException | None:
    """restore_leftovers of what was not suspended before (when ``suspended_before`` is
    given), then ``resume(tags)``; a step cut short by Ctrl-C is done again (both are
    idempotent), and the interrupt returned for the caller to raise. A failed restore still
    resumes the tags, then raises."""
    interrupt: BaseException | None = None
    failure: Exception | None = None
    for _ in range(16):
        try:
            if suspended_before is not None and failure is None:
                try:
                    leftovers.restore(nccl_suspend.suspended_names() - suspended_before)
                except Exception as error:  # noqa: BLE001 - raised once the tags are resumed
                    failure = error
            resume(tags)
            break
        except KeyboardInterrupt as error:
            interrupt = interrupt or error
    if failure is not None:
        raise failure
    return interrupt
