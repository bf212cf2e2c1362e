"""What a pause or resume did, as one INFO line on the ``torch_mem_saver_lite`` logger: the
tags it changed, bytes, time and speed, and the node's host memory after it; for a resume,
what each tag's wake check found and the stray writes it noticed. The figures cost a table
walk before and after, so they are gathered only while INFO is on. At DEBUG also each region's
entry and exit and each pause or resume asked, with the bytes of the tags concerned (what the
native library does per allocation and free: ``TMSL_LOG_ALLOCATIONS=1``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from . import _lib
from .stats import wake_check

logger = logging.getLogger("torch_mem_saver_lite")
_GiB, _MiB = 1 << 30, 1 << 20

NativeCall = Callable[[list[str] | None], None]


def _line(what: str, before: dict, after: dict, seconds: float) -> None:
    changed = sorted(t for t, v in after.items() if v["paused"] != before.get(t, {}).get("paused", False))
    if not changed:
        return
    moved = sum(after[t]["reserved_bytes"] for t in changed)
    copied = sum((after if what == "pause" else before)[t]["host_backup_bytes"] for t in changed)
    host = _lib.host_memory()
    # A resume's checks: each tag's wake verdict, and writes found in its paused memory.
    checks = "".join(f"; {t}: wake {wake_check(after[t]['last_wake_check'])}" for t in changed
                     if what == "resume" and wake_check(after[t]["last_wake_check"]) is not None)
    checks += "".join(f"; {t}: {after[t]['stray_writes'] - before[t]['stray_writes']} stray write check(s) found "
                      "writes" for t in changed
                      if what == "resume" and after[t]["stray_writes"] > before.get(t, {}).get("stray_writes", 0))
    logger.info("%s %s: %.2f GiB of device memory %s, %.2f GiB %s host memory, in %.1f ms (%.1f GB/s); "
                "node host memory %.2f of %.2f GiB held (this process %.2f)%s",
                what, changed, moved / _GiB, "released" if what == "pause" else "mapped again",
                copied / _GiB, "backed up to" if what == "pause" else "restored from", seconds * 1e3,
                copied / seconds / 1e9 if copied and seconds > 0 else 0.0,
                (host.held_by_this_process + host.held_by_others) / _GiB, host.budget_bytes / _GiB,
                host.held_by_this_process / _GiB, checks)


def _logged(what: str, native: _lib.NativeSaver, call: NativeCall, names: list[str] | None) -> None:
    before = native.stats()
    start = time.perf_counter()
    call(names)
    _line(what, before, native.stats(), time.perf_counter() - start)


def _held(native: _lib.NativeSaver, tags: list[str] | None) -> str:
    figures = native.stats()
    chosen = [t for t in (tags if tags is not None else figures) if t in figures]
    return ", ".join(f"{t!r}: {figures[t]['allocations']} allocations, {figures[t]['reserved_bytes'] / _MiB:.2f} MiB "
                     f"({figures[t]['resident_bytes'] / _MiB:.2f} MiB resident)" for t in chosen) or "no tag"


def region_entered(native: _lib.NativeSaver, tag: str, choice: int) -> None:
    """DEBUG: a region opened (its backup choice as the C ABI numbers it)."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("region %r entered (backup choice %d); %s", tag, choice, _held(native, [tag]))


def region_left(native: _lib.NativeSaver, tag: str) -> None:
    """DEBUG: a region closed, with what its tag holds now."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("region %r left; %s", tag, _held(native, [tag]))


def asked(what: str, native: _lib.NativeSaver, tags: list[str] | None) -> None:
    """DEBUG: a pause or resume of ``tags`` (None: every tag) is asked, with what they hold."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s of %s asked; %s", what, "every tag" if tags is None else tags, _held(native, tags))


def wrap(what: str, native: _lib.NativeSaver, call: NativeCall) -> NativeCall:
    """``call`` (the native pause or resume), logged where INFO is on; else ``call`` itself
    (no frame, no figures)."""
    if not logger.isEnabledFor(logging.INFO):
        return call
    return lambda names: _logged(what, native, call, names)
