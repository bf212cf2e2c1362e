"""Each thread's stack of regions: which saver, tag and backup choice its allocations go to,
and which torch pool routes them, kept true whatever interrupts a block.

A region entry makes itself current with one C call (the native thread region) and one
torch routing step; leaving a block settles the thread back on the enclosing entry, also
after an interrupt (``Undo``). Entries of several savers nest on one stack per thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from . import _lib, interrupts
from .errors import MemorySaverError
from .pool_routing import Route, begin_route, end_route, release_route

logger = logging.getLogger("torch_mem_saver_lite")

# Regions nest per thread, across savers: one stack of Region entries a thread.
_thread = threading.local()


class Region:
    """One entry of a thread's region stack: a native region (None: saver.disable()) and
    the torch pool route that go with it. What the C ABI and torch take is computed here,
    so that making an entry current is a single C call each (see pushed)."""

    __slots__ = ("native", "route", "checked", "_handle", "_tag", "_choice")

    def __init__(self, native: _lib.NativeSaver | None, tag: str = "", choice: int = _lib.CHOICE_AUTO,
                 route: Route | None = None, checked: bool = True):
        self.native, self.checked = native, checked  # checked=False: entered without the tag checks
        self.route = None if route is None else (route[0], route[1].id)  # (device, pool id)
        self._handle = native.handle if native is not None else None
        self._tag, self._choice = tag.encode(), choice

    def enter(self) -> int:
        """Check the region against its saver's tag catalogue and make it current natively."""
        if not self.checked:
            self.restore()
            return 0
        if self.native is None:
            return _lib.disable_thread_region()
        return _lib.enter_region(self._handle, self._tag, self._choice)

    def restore(self) -> None:
        """Make this (enclosing) entry current natively again, without the checks."""
        if self.native is None:
            _lib.disable_thread_region()
        else:
            _lib.set_thread_region(self._handle, self._tag, self._choice)


def _stack() -> list[Region]:
    return _thread.__dict__.setdefault("stack", [])


# The threads torch routes to one of our pools now, and disable()'s pools waiting to be freed
# (with their device). torch refuses to free any pool's cache while some thread is routed on
# the device (it counts routes as captures underway, and ends the process), so a disable()
# block's pool is freed once no thread is routed, and reused by the next block meanwhile.
# Routes the saver does not make (a user's torch.cuda.use_mem_pool, a graph capture) are not
# seen here.
_routed_threads: dict[int, tuple] = {}
_parked_pools: list[tuple[int, torch.cuda.MemPool]] = []


def disable_pool(device: int) -> torch.cuda.MemPool:
    """A pool for a disable() block on ``device``: a parked one, else a new one."""
    for k, (parked_device, pool) in enumerate(_parked_pools):
        if parked_device == device:
            del _parked_pools[k]
            return pool
    return torch.cuda.MemPool()


def retire_pool(route: tuple[int, torch.cuda.MemPool] | None) -> None:
    """Free a disable() block's pool, now unused, and those parked earlier, or park it until
    no thread is routed. No lock: an interrupt could leave one held; each list step is atomic
    under the GIL (a route begun between the check and the clear is the one race left)."""
    if route is not None:
        _parked_pools.append(route)
    if not _routed_threads:
        _parked_pools.clear()  # torch frees each pool's cached blocks as it goes


def _route_to(target: tuple | None) -> None:
    """Make ``target`` ((device, pool id), or None) the torch pool this thread's allocations
    go to. torch counts a reference per begin, which an end plus a release give back. Each
    step is one call and its record on one line, so an interrupt between steps leaves the
    record true and calling this again finishes the job."""
    state = _thread.__dict__
    if state.get("unreleased") is not None:
        with interrupts.deferred():
            release_route(*state["unreleased"])
            state["unreleased"] = None
    current = state.get("route")
    # The record of routed threads follows the route itself, also after an interrupt.
    if current is None:
        _routed_threads.pop(threading.get_ident(), None)
    else:
        _routed_threads[threading.get_ident()] = current
    if current == target:
        return
    if current is not None:
        with interrupts.deferred():
            end_route(*current)
            state["unreleased"], state["route"] = current, None
        _routed_threads.pop(threading.get_ident(), None)
        with interrupts.deferred():
            release_route(*current)
            state["unreleased"] = None
    if target is not None:
        _routed_threads[threading.get_ident()] = target
        with interrupts.deferred():
            begin_route(*target)
            state["route"] = target


def _settle(stack: list[Region], depth: int) -> BaseException | None:
    """Make the thread's native region and torch route those of ``stack[:depth]``. An
    interrupt (Ctrl-C) in the middle makes it start over; it is returned once all is
    settled, for the caller to raise."""
    interrupt = None
    for _ in range(16):
        try:
            del stack[depth:]
            top = stack[-1] if stack else None
            _route_to(top.route if top is not None else None)
            if top is not None:
                top.restore()
            else:
                _lib.set_thread_region(None, None, 0)  # back to the process defaults
            break
        except BaseException as error:  # noqa: BLE001 - handed back, once settled
            interrupt = interrupt or error
    return interrupt


class Undo:
    """Runs an undo action exactly once: from the finally clause that owns it, or, should
    an interrupt land on that clause's first line (before the call), when the frame holding
    it is torn down by that very interrupt (on the thread it belongs to). The action is
    idempotent and returns an interrupt it deferred, raised here once the action is done."""

    __slots__ = ("_action", "_thread")

    def __init__(self, action: Callable[[], BaseException | None]) -> None:
        # The thread first: once the action is set, __del__ finds everything it reads.
        self._thread = threading.get_ident()
        self._action: Callable[[], BaseException | None] | None = action

    def __call__(self) -> None:
        with interrupts.deferred():  # taken and run as one step: never twice, never skipped
            action, self._action = self._action, None
            interrupt = action() if action is not None else None
        if interrupt is not None:
            raise interrupt

    def __del__(self) -> None:
        # getattr: an interrupt may have cut __init__ short before the action was set.
        if getattr(self, "_action", None) is not None and threading.get_ident() == self._thread:
            with contextlib.suppress(BaseException):  # the interrupt itself is already on its way
                self()


@contextlib.contextmanager
def pushed(entry: Region) -> Iterator[None]:
    """Make ``entry`` this thread's region for the block. A region is checked against its
    saver's tag catalogue first (a paused tag raises). Whatever interrupts the block or its
    entry, on the way out the thread's state is again that of the enclosing entries."""
    stack = _stack()
    undo = Undo(functools.partial(_settle, stack, len(stack)))
    try:
        if entry.enter() != 0:
            raise _lib.last_error()
        stack.append(entry)
        _route_to(entry.route)
        yield
    finally:
        undo()
        if _parked_pools and not _routed_threads:
            retire_pool(None)


@contextlib.contextmanager
def refusals_explained(tag: str) -> Iterator[None]:
    """torch reports an allocation the saver refused as its own error: chained to the saver's,
    which says why (the caller cleared the thread's failure mark before the region)."""
    try:
        yield
    except RuntimeError as error:
        if not isinstance(error, MemorySaverError) and _lib.take_allocation_failure():
            cause = _lib.last_error()
            logger.warning("an allocation in tag %r was refused: %s", tag, cause)
            raise error from cause
        raise


def prepare_quietly(native: _lib.NativeSaver, tag: str) -> None:
    """Have host memory for the tag's backups set aside in the background, for its first
    pause. Best effort: a saver closed inside the block, say, just skips it."""
    with contextlib.suppress(MemorySaverError):
        native.prepare_backups([tag])
