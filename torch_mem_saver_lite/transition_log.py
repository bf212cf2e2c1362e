"""What a pause or resume did, as one INFO line on the ``torch_mem_saver_lite`` logger: the
tags it changed, bytes, time and speed, and the node's host memory after it; for a resume,
what each tag's wake check found and the stray writes it noticed. The figures cost a table
walk before and after, so they are gathered only while INFO is on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from . import _lib
from .stats import wake_check

logger = logging.getLogger("torch_mem_saver_lite")
_GiB = 1 << 30

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


def wrap(what: str, native: _lib.NativeSaver, call: NativeCall) -> NativeCall:
    """``call`` (the native pause or resume), logged where INFO is on; else ``call`` itself
    (no frame, no figures)."""
    if not logger.isEnabledFor(logging.INFO):
        return call
    return lambda names: _logged(what, native, call, names)
