"""Stray access to paused memory without a backup (a KV cache a data-parallel dummy batch
touches while its engine sleeps): the modes, and what a resume says of the writes the core
found. The core does the catching (csrc/core/stray_catcher.h): while such memory is paused, its
addresses map a small scratch of device memory, so a stray kernel reads the scratch's 0xFF
bytes and writes into it instead of meeting an unmapped address, and a write changes the
scratch's fingerprint, which each pause and resume on the device compares."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from . import _lib
from .choices import STRAY_ACCESS_MODES
from .errors import StrayAccessError, StrayAccessWarning

# In the core's order (StrayMode, csrc/core/saver.h): a mode's number is its index.
MODES = STRAY_ACCESS_MODES
OFF, WARN, RAISE = range(3)


def check_mode(mode: object, name: str = "stray_access") -> int:
    """The core's number of a mode name, else TypeError/ValueError naming ``name``."""
    if not isinstance(mode, str):
        raise TypeError(f"{name} must be one of {MODES}, got {type(mode).__name__}")
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {MODES}, got {mode!r}")
    return MODES.index(mode)


def message(tag: str, count: int) -> str:
    checks = "a check" if count == 1 else f"{count} checks"
    return (f"tag {tag!r} was written to while paused ({checks} found writes in its memory without a backup): "
            "something still used that memory while it slept (a dummy batch, a CUDA graph replay, a weight "
            "update). The writes went to the saver's scratch memory and were dropped; the tag is awake now and "
            "that memory's content is undefined, as after any resume without a backup. stray_access='raise' "
            "(TMSL_STRAY_ACCESS=raise) makes this an error, 'off' gives the raw behaviour (an illegal address).")


def report(native: _lib.NativeSaver, names: Sequence[str] | None) -> None:
    """After a resume of ``names`` (None: every tag): a StrayAccessWarning for each tag it left
    awake in which writes were found while paused, or one StrayAccessError for those whose mode
    is "raise" (the tags stay awake). Each finding is told once. Asks the core only where a
    resume said there is something to tell."""
    if not native.take_strays_to_tell():
        return
    found: dict[int, dict[str, int]] = {WARN: {}, RAISE: {}}
    for tag in names if names is not None else list(native.stats()):
        count, mode = native.take_stray_writes(tag)
        if count and mode in found:
            found[mode][tag] = count
    for tag, count in found[WARN].items():
        warnings.warn(StrayAccessWarning(f"torch_mem_saver_lite: {message(tag, count)}"), stacklevel=3)
    if found[RAISE]:
        raise StrayAccessError(" ".join(message(tag, count) for tag, count in found[RAISE].items()), found[RAISE])
