"""Releasing what a process holds on the GPU outside the saver's regions, after a pause.

``saver.release_leftovers()`` gives back (a) the caching allocator's free blocks: torch's
own (``torch.cuda.empty_cache()`` on every device) and those cached in the saver's per-tag
pools of resident tags that nothing else uses (no open region, no captured graph), and (b)
the device memory of NCCL communicators, suspended (nccl_suspend.py). What it could not
release, and why, is in the returned report. ``saver.restore_leftovers()`` resumes the
communicators; the caches need nothing back (torch allocates again on demand).

On request (``cublas_workspaces=True``), torch's cuBLAS workspaces too. Not released:
tensors alive outside regions, cuDNN workspaces held by live handles, the CUDA context and
loaded kernels, memory other libraries allocated themselves, cached blocks of paused tags
(already off the device) and of pools a region or a CUDA graph still uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import _lib, nccl_suspend
from .breakdown import MemoryBreakdown, breakdowns, devices_in_use, record_baseline
from .nccl_suspend import GroupOutcome
from .pool_routing import TorchPools

_MiB = 1 << 20


@dataclass(frozen=True)
class LeftoverReport:
    """What ``saver.release_leftovers()`` released, what it could not, and what is left.

    Attributes:
        torch_cache_bytes: free blocks of torch's caching allocator given back (torch's
            reserved memory fell by this much across ``torch.cuda.empty_cache()``).
        saver_pool_cache_bytes: free blocks cached in idle saver pools given back.
        nccl_bytes: device memory the communicator suspends of this call gave back.
        groups: one outcome per NCCL process group: suspended or not, how, and why not.
        breakdowns: the memory breakdown of each device the process uses, afterwards.
        notes: what was left on purpose, or could not be looked at.
    """

    torch_cache_bytes: int = 0
    saver_pool_cache_bytes: int = 0
    nccl_bytes: int = 0
    groups: tuple[GroupOutcome, ...] = ()
    breakdowns: tuple[MemoryBreakdown, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def released_bytes(self) -> int:
        """Device bytes released in all: torch's cache, the saver pools' cache and NCCL's."""
        return self.torch_cache_bytes + self.saver_pool_cache_bytes + self.nccl_bytes

    @property
    def breakdown(self) -> MemoryBreakdown | None:
        """The breakdown of the device that was current (None without a GPU)."""
        return self.breakdowns[0] if self.breakdowns else None

    @property
    def not_suspended(self) -> tuple[GroupOutcome, ...]:
        """The process groups whose communicators stayed up (each says why)."""
        return tuple(g for g in self.groups if not g.suspended)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain values (for JSON), its breakdowns and groups included."""
        return {"torch_cache_bytes": self.torch_cache_bytes, "saver_pool_cache_bytes": self.saver_pool_cache_bytes,
                "nccl_bytes": self.nccl_bytes, "released_bytes": self.released_bytes,
                "groups": [vars(g).copy() for g in self.groups],
                "breakdowns": [b.as_dict() for b in self.breakdowns], "notes": list(self.notes)}

    def __str__(self) -> str:
        lines = ["released leftovers"]
        for label, value in (("torch cached free blocks", self.torch_cache_bytes),
                             ("saver pools' cached free blocks", self.saver_pool_cache_bytes),
                             ("NCCL communicators", self.nccl_bytes), ("total", self.released_bytes)):
            lines.append(f"  {label:<34}{value / _MiB:>12.1f} MiB")
        for g in self.groups:
            state = f"suspended ({g.mechanism}, {g.released_bytes / _MiB:.1f} MiB)" if g.suspended else "NOT suspended"
            lines.append(f"  NCCL group {g.group!r} on GPU {g.device}: {state}" + (f": {g.reason}" if g.reason else ""))
        lines += [f"  note: {note}" for note in self.notes]
        lines += [str(b) for b in self.breakdowns]
        return "\n".join(lines)


def _reserved(devices: list[int]) -> int:
    return sum(int(torch.cuda.memory_reserved(d)) for d in devices)


def _release_caches(pools: TorchPools | None, native: Any, devices: list[int], notes: list[str],
                    cublas_workspaces: bool) -> tuple[int, int]:
    """(torch's free blocks, idle saver pools' free blocks) given back, in bytes."""
    before = _reserved(devices)
    if cublas_workspaces:
        # cuBLAS workspaces (32 MiB each on Hopper, one per thread and stream) are live blocks:
        # one cut out of a freed multi-GiB activation segment keeps the whole segment reserved
        # (the RL example's trainer left gigabytes that way). torch makes them again on next
        # use. Opt-in: a graph that recorded a workspace from outside its pool would replay
        # into freed memory (see release_leftovers).
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is None:
            notes.append(f"torch {torch.__version__} cannot clear its cuBLAS workspaces: they stay")
        else:
            clear_workspaces()
    torch.cuda.empty_cache()
    middle = _reserved(devices)
    if pools is None or native is None:
        return max(0, before - middle), 0
    active = {t for t in native.stats() if native.tag_state(t) == _lib.TAG_ACTIVE}
    dropped, kept = pools.drop_idle(active)
    if dropped:
        torch.cuda.empty_cache()
    if kept:
        notes.append(f"saver pools kept (a region is open in them or a CUDA graph uses them): {sorted(kept)}")
    return max(0, before - middle), max(0, middle - _reserved(devices))


def release(pools: TorchPools | None, native: Any, routes_torch: bool, groups: list[Any] | None,
            cublas_workspaces: bool = False) -> LeftoverReport:
    """The work of ``saver.release_leftovers`` (``groups``: checked, None for every NCCL group)."""
    notes: list[str] = []
    on_gpu = routes_torch and torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = devices_in_use() if on_gpu else []
    current = int(torch.cuda.current_device()) if on_gpu else None
    devices = sorted(devices, key=lambda d: d != current)  # the current device first
    for device in devices:
        record_baseline(device, native)  # before releasing, if it was never taken
    torch_bytes = pool_bytes = 0
    if devices:
        torch_bytes, pool_bytes = _release_caches(pools, native, devices, notes, cublas_workspaces)
    elif routes_torch:
        notes.append("torch sees no CUDA GPU: no caching allocator to empty" if not torch.cuda.is_available()
                     else "CUDA is not initialized in this process: no caching allocator to empty")
    chosen = nccl_suspend.nccl_groups() if groups is None else groups
    if groups is None and not chosen:
        notes.append("no NCCL process group exists in this process: no communicator to suspend")
    outcomes = []
    for group in chosen:
        if on_gpu:
            torch.cuda.synchronize()  # collectives in flight finish before their buffers go
        outcomes.append(nccl_suspend.suspend_group(group))
    nccl_bytes = sum(o.released_bytes for o in outcomes)
    after = breakdowns(devices, native) if devices else ()
    return LeftoverReport(torch_bytes, pool_bytes, nccl_bytes, tuple(outcomes), after, tuple(notes))


def restore(names: set[str] | None = None) -> tuple[GroupOutcome, ...]:
    """Resume the communicators release() suspended (``names``: only those). Idempotent."""
    return tuple(nccl_suspend.resume_groups(names))
