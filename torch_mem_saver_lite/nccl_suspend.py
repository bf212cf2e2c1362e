"""Suspending the device memory of NCCL communicators while memory is paused.

An NCCL communicator holds device buffers (0.5-1 GiB per communicator is common) for as long
as it lives. NCCL 2.29.7 added ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` /
``ncclCommResume(comm)``, which release and restore them while keeping the communicator
(its topology, connections and buffer addresses); PyTorch wraps the same calls as
``ProcessGroup._get_backend(cuda).suspend()`` / ``.resume()`` in newer releases. This module
uses torch's where the installed torch has it, else NCCL's own through ctypes on the NCCL
library the process has loaded (``ProcessGroupNCCL._comm_ptr()`` gives the ``ncclComm_t``),
and where neither exists it says why, per group, instead of leaving the memory silently.

Rules that come from NCCL, not from us:
- suspend and resume are collective: every rank of a group must call them, in the same
  order of groups (``saver.release_leftovers()`` takes the groups in creation order);
- a suspended communicator must not be used: no collective, no send/recv, no destroy.
  While a group is suspended, the Python-level collectives of ``torch.distributed`` on it
  raise ``MemorySaverError`` (a guard on ``ProcessGroup``'s methods); calls that bypass them
  (DDP's reducer, C++ extensions, functional collectives under torch.compile) are not seen.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import interrupts
from .errors import MemorySaverError

# NCCL's ncclCommSuspend flag: release the communicator's dynamic device memory.
NCCL_SUSPEND_MEM = 0x01
# The first NCCL release with ncclCommSuspend / ncclCommResume / ncclCommMemStats.
NCCL_SUSPEND_VERSION = (2, 29, 7)
# ncclCommMemStats counters (nccl.h): total, not suspendable, suspendable, suspended (0/1).
_NCCL_STAT_TOTAL, _NCCL_STAT_PERSIST, _NCCL_STAT_SUSPENDABLE = 0, 1, 2


@dataclass(frozen=True)
class GroupOutcome:
    """What release_leftovers / restore_leftovers did with one process group.

    Attributes:
        group: the group's name (``ProcessGroup.group_name``).
        device: the CUDA device of its communicator (None when unknown).
        suspended: the group's communicator memory is suspended after the call.
        mechanism: ``"torch"`` (ProcessGroup backend suspend), ``"nccl"`` (ncclCommSuspend
            through ctypes) or ``""`` (none was used).
        released_bytes: device memory the suspend gave back, measured as the device's free
            memory rising across it (0 when not suspended by this call).
        reason: why the group was not suspended, or a note on how it was.
    """

    group: str
    device: int | None
    suspended: bool
    mechanism: str = ""
    released_bytes: int = 0
    reason: str = ""


@dataclass
class _Suspended:
    """A group this process suspended, and how to resume it."""

    group: Any  # the ProcessGroup
    name: str
    device: int
    mechanism: str
    released_bytes: int
    resume: Callable[[], None] = field(repr=False)


# Process-wide: a communicator is suspended once, whichever saver asked.
_lock = threading.RLock()
_suspended: dict[str, _Suspended] = {}
# Device memory measured as released by the last suspend of each group (name -> (device, bytes)),
# kept after resume: the breakdown's estimate of what NCCL holds while active.
_measured: dict[str, tuple[int, int]] = {}


def _version_text(code: int) -> str:
    # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9 (major*1000 + minor*100 before).
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


@dataclass(frozen=True)
class NcclLibrary:
    """The NCCL shared library this process has loaded (None fields: not found)."""

    path: str | None
    version: str | None
    has_suspend: bool
    handle: Any = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        if self.path is None:
            return "no NCCL shared library is loaded in this process"
        where = f"the NCCL it loaded ({self.version or 'version unknown'}, {self.path})"
        if self.has_suspend:
            return f"{where} has ncclCommSuspend"
        needed = ".".join(map(str, NCCL_SUSPEND_VERSION))
        return f"{where} has no ncclCommSuspend (added in NCCL {needed})"


def _loaded_nccl_path() -> str | None:
    """The path of the libnccl this process mapped (torch's wheels load it dynamically)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libnccl" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def _load_nccl(path: str) -> NcclLibrary:
    try:
        handle = ctypes.CDLL(path)  # already mapped: this only takes a reference
    except OSError:
        return NcclLibrary(path, None, False)
    version = None
    with contextlib.suppress(AttributeError):
        code = ctypes.c_int(0)
        if handle.ncclGetVersion(ctypes.byref(code)) == 0:
            version = _version_text(code.value)
    has_suspend = all(hasattr(handle, name) for name in ("ncclCommSuspend", "ncclCommResume"))
    if has_suspend:
        handle.ncclCommSuspend.argtypes = [ctypes.c_void_p, ctypes.c_int]
        handle.ncclCommResume.argtypes = [ctypes.c_void_p]
        handle.ncclGetErrorString.restype = ctypes.c_char_p
        handle.ncclGetErrorString.argtypes = [ctypes.c_int]
    return NcclLibrary(path, version, has_suspend, handle)


def nccl_library() -> NcclLibrary:
    """The NCCL library this process has loaded, and whether it can suspend communicators."""
    path = _loaded_nccl_path()
    if path is None:
        return NcclLibrary(None, None, False)
    return _load_nccl(path)


# ----- which groups ------------------------------------------------------------------------
def _distributed() -> Any:
    """torch.distributed when it is usable here (None: torch built without it)."""
    import torch.distributed as dist

    return dist if dist.is_available() else None


def group_name(group: Any) -> str:
    return str(getattr(group, "group_name", None) or hex(id(group)))


def cuda_backend(group: Any) -> Any:
    """The group's CUDA backend (ProcessGroupNCCL for NCCL groups), or None."""
    try:
        return group._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - a group without a CUDA backend raises RuntimeError
        return None


def is_nccl_group(group: Any) -> bool:
    backend = cuda_backend(group)
    if backend is None:
        return False
    name = getattr(backend, "name", None)
    with contextlib.suppress(Exception):
        return "nccl" in str(name() if callable(name) else name).lower()
    return "nccl" in type(backend).__name__.lower()


def nccl_groups() -> list[Any]:
    """Every NCCL process group torch.distributed has created in this process and this rank
    belongs to, in creation order (the same on every rank, as torch requires)."""
    dist = _distributed()
    if dist is None or not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return [group for group in list(distributed_c10d._world.pg_map) if is_nccl_group(group)]


def check_groups(process_groups: object) -> list[Any] | None:
    """``process_groups`` as a list of ProcessGroups (None: every NCCL group). Raises
    TypeError/ValueError naming what is wrong; non-member sentinels are dropped."""
    if process_groups is None:
        return None
    dist = _distributed()
    group_type = dist.ProcessGroup if dist is not None else None
    if group_type is not None and isinstance(process_groups, group_type):
        process_groups = [process_groups]
    if not isinstance(process_groups, (list, tuple)):
        raise TypeError(f"process_groups must be None, a torch.distributed.ProcessGroup or a list of them, "
                        f"got {type(process_groups).__name__}")
    non_member = dist.GroupMember.NON_GROUP_MEMBER if dist is not None else object()
    groups = []
    for index, group in enumerate(process_groups):
        if group is non_member:
            continue  # this rank is not in that subgroup (what new_group returns to non-members)
        if group_type is None or not isinstance(group, group_type):
            raise TypeError(f"process_groups[{index}] must be a torch.distributed.ProcessGroup, "
                            f"got {type(group).__name__}")
        groups.append((index, group))
    for index, group in groups:
        if not is_nccl_group(group):
            raise ValueError(f"process_groups[{index}] ({group_name(group)!r}) has no NCCL backend, so it holds "
                             "no communicator memory on the GPU; pass NCCL groups only (or None for all of them)")
    return [group for _, group in groups]


def torch_suspend_missing() -> str | None:
    """Why this torch has no process-group suspend (None: it has one)."""
    from torch._C import _distributed_c10d as c10d

    backend = getattr(c10d, "Backend", None)
    if backend is None or not hasattr(backend, "suspend") or not hasattr(backend, "resume"):
        return f"torch {torch.__version__} has no process-group suspend"
    return None


# ----- suspend / resume of one group ---------------------------------------------------------
def _comm_device(group: Any, backend: Any) -> int:
    bound = getattr(group, "bound_device_id", None)
    if isinstance(bound, torch.device) and bound.index is not None:
        return bound.index
    return torch.cuda.current_device()


def _free_bytes(device: int) -> int:
    torch.cuda.synchronize(device)
    return int(torch.cuda.mem_get_info(device)[0])


def _nccl_error(nccl: NcclLibrary, result: int) -> str:
    with contextlib.suppress(Exception):
        return f"{nccl.handle.ncclGetErrorString(result).decode()} (ncclResult_t {result})"
    return f"ncclResult_t {result}"


def _torch_mechanism(backend: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(suspend, resume) through torch's process-group backend."""
    return backend.suspend, backend.resume


def _nccl_mechanism(backend: Any, nccl: NcclLibrary) -> tuple[Callable[[], None], Callable[[], None]]:
    """(suspend, resume) through ncclCommSuspend / ncclCommResume on the group's communicator."""
    comm = ctypes.c_void_p(int(backend._comm_ptr()))

    def call(function: Any, *args: Any) -> None:
        result = function(comm, *args)
        if result != 0:
            raise MemorySaverError(f"{function.__name__} failed: {_nccl_error(nccl, result)}")
    return (functools.partial(call, nccl.handle.ncclCommSuspend, NCCL_SUSPEND_MEM),
            functools.partial(call, nccl.handle.ncclCommResume))


def _nccl_path_missing(backend: Any, nccl: NcclLibrary) -> str | None:
    """Why NCCL's own suspend cannot be used on this group (None: it can)."""
    if not nccl.has_suspend:
        return nccl.describe()
    if not callable(getattr(backend, "_comm_ptr", None)):
        return f"torch {torch.__version__}'s ProcessGroupNCCL does not expose its communicator (_comm_ptr)"
    try:
        pointer = int(backend._comm_ptr())
    except Exception as error:  # noqa: BLE001 - reported as the reason
        return f"ProcessGroupNCCL._comm_ptr() failed: {error}"
    if pointer == 0:
        return ("the group has no NCCL communicator yet (torch creates it at the first collective unless "
                "init_process_group got device_id): nothing to release")
    return None


def suspend_group(group: Any) -> GroupOutcome:
    """Suspend ``group``'s communicator memory (collective: every rank must call it)."""
    name = group_name(group)
    backend = cuda_backend(group)
    device = _comm_device(group, backend)
    with _lock:
        if name in _suspended:
            return GroupOutcome(name, device, True, _suspended[name].mechanism, 0, "already suspended")
        reasons = []
        mechanisms: list[tuple[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]] = []
        torch_missing = torch_suspend_missing()
        if torch_missing is None:
            mechanisms.append(("torch", functools.partial(_torch_mechanism, backend)))
        else:
            reasons.append(torch_missing)
        nccl = nccl_library()
        nccl_missing = _nccl_path_missing(backend, nccl)
        if nccl_missing is None:
            mechanisms.append(("nccl", functools.partial(_nccl_mechanism, backend, nccl)))
        else:
            reasons.append(nccl_missing)
        for mechanism, make in mechanisms:
            suspend, resume = make()
            entry = _Suspended(group, name, device, mechanism, 0, resume)
            free_before = _free_bytes(device)
            try:
                with interrupts.deferred():  # once suspended, the group is on record (restore_leftovers finds it)
                    suspend()
                    _suspended[name] = entry
                    _install_guard()
            except Exception as error:  # noqa: BLE001 - the next mechanism, or the reason reported
                reasons.append(f"{mechanism} suspend failed: {error}")
                continue
            entry.released_bytes = max(0, _free_bytes(device) - free_before)
            _measured[name] = (device, entry.released_bytes)
            return GroupOutcome(name, device, True, mechanism, entry.released_bytes, "")
        return GroupOutcome(name, device, False, "", 0, "; ".join(reasons) or "no suspend mechanism")


def suspended_names() -> set[str]:
    with _lock:
        return set(_suspended)


def resume_groups(names: Iterable[str] | None = None) -> list[GroupOutcome]:
    """Resume the groups this process suspended (``names``: only those), newest first. Every
    group is attempted; the first failure is raised once all were tried."""
    outcomes, failure = [], None
    with _lock:
        chosen = [n for n in reversed(list(_suspended)) if names is None or n in set(names)]
        for name in chosen:
            entry = _suspended[name]
            try:
                with interrupts.deferred():  # resumed means off the record
                    entry.resume()
                    del _suspended[name]
            except Exception as error:  # noqa: BLE001 - raised below, after the others were tried
                failure = failure or MemorySaverError(f"resuming NCCL process group {name!r} failed: {error}")
                outcomes.append(GroupOutcome(name, entry.device, True, entry.mechanism, 0, f"resume failed: {error}"))
                continue
            outcomes.append(GroupOutcome(name, entry.device, False, entry.mechanism, 0, "resumed"))
        if not _suspended:
            _remove_guard()
    if failure is not None:
        raise failure
    return outcomes


def nccl_bytes(device: int) -> tuple[int, int, list[str]]:
    """(bytes NCCL communicators hold on ``device`` as far as measured, bytes suspended now,
    notes) from what suspends measured in this process."""
    with _lock:
        suspended = sum(s.released_bytes for s in _suspended.values() if s.device == device)
        active = sum(b for n, (d, b) in _measured.items() if d == device and n not in _suspended)
    notes = []
    groups = [g for g in nccl_groups() if _comm_device(g, None) == device] if torch.cuda.is_available() else []
    unmeasured = [group_name(g) for g in groups if group_name(g) not in _measured]
    if unmeasured:
        notes.append(f"NCCL groups {unmeasured} were never suspended, so their memory is not measured: it counts "
                     "in cuda_context if they existed when the baseline was taken, else in unknown")
    elif active:
        notes.append("nccl: what the last suspend of each active group released")
    return active, suspended, notes


# ----- refusing collectives on suspended groups ----------------------------------------------
_GUARDED = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
            "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce", "reduce_scatter",
            "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
            "barrier", "monitored_barrier", "send", "recv", "recv_anysource", "gather", "scatter")
_originals: dict[str, Any] = {}


def _guarded(name: str, original: Any) -> Callable[..., Any]:
    def guard(self: Any, *args: Any, **kwargs: Any) -> Any:
        if group_name(self) in _suspended:
            raise MemorySaverError(
                f"{name} on NCCL process group {group_name(self)!r} while its communicator is suspended by "
                "saver.release_leftovers(): a suspended communicator must not be used; call "
                "saver.restore_leftovers() (on every rank) first")
        return original.__get__(self, type(self))(*args, **kwargs)
    guard.__name__ = name
    return guard


def _install_guard() -> None:
    """Make torch.distributed's collectives on a suspended group raise instead of hanging or
    touching released memory (installed only while something is suspended)."""
    if _originals:
        return
    from torch._C import _distributed_c10d as c10d

    cls = c10d.ProcessGroup
    for name in _GUARDED:
        raw = cls.__dict__.get(name)
        if raw is not None:
            _originals[name] = raw
            setattr(cls, name, _guarded(name, raw))


def _remove_guard() -> None:
    if not _originals:
        return
    from torch._C import _distributed_c10d as c10d

    for name, raw in _originals.items():
        setattr(c10d.ProcessGroup, name, raw)
    _originals.clear()
